"""`skyline bench run` options, and the --quick / full presets (argparse only: cheap to import).

Options left unset take the preset's value: the full run by default, or the
quick one with --quick. The full run is what BENCHMARKS.md's figures use; the
quick run finishes in under 10 minutes on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse

# Full run (~1.5 h on the 2-core CPU machine with the four default systems):
# six rates, 2 minutes of arrivals each, generous drain and probe.
FULL = {
    "rates": "0.1,0.2,0.3,0.5,0.75,1.0", "duration": 120.0, "drain": 120.0, "probe_requests": 5, "warmup": 3,
    "chat_prompt": "30-300", "rag_prompt": "1200-1800", "chat_output": "16-64", "rag_output": "16-64",
}
# Quick run (< 10 min): two rates, short runs, short outputs so each rate drains fast.
QUICK = {
    "rates": "0.15,0.4", "duration": 25.0, "drain": 15.0, "probe_requests": 2, "warmup": 2,
    "chat_prompt": "30-300", "rag_prompt": "1000-1600", "chat_output": "8-24", "rag_output": "8-24",
}


# Systems run when --systems is not given, per workload (names as in skyline.tools.bench.systems).
DEFAULT_SYSTEMS = {"mixed": "vllm-fcfs,vllm-priority,skyline-colocated,skyline-disagg",
                   "multiturn": "vllm-rr,skyline-affinity,skyline-no-affinity",
                   "lora": "vllm-lora-rr,skyline-lora-blind,skyline-lora-aware"}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    # Names spelled out (not imported from skyline.tools.bench.systems) so building the CLI parser stays cheap.
    p.add_argument("--systems",
                   help="comma-separated, run in this order; the first is the SLO baseline (default: "
                        f"{DEFAULT_SYSTEMS['mixed']}; with --workload multiturn: {DEFAULT_SYSTEMS['multiturn']}; "
                        f"with --workload lora: {DEFAULT_SYSTEMS['lora']}). "
                        "Known: vllm-fcfs, vllm-priority, skyline-colocated, skyline-disagg, vllm-rr, skyline-affinity, "
                        "skyline-no-affinity, skyline-disagg-affinity, skyline-disagg-no-affinity, sim-colocated, "
                        "sim-disagg, sim-affinity, sim-no-affinity, sim-disagg-affinity, sim-disagg-no-affinity, "
                        "skyline-elastic, sim-elastic, vllm-lora-rr, skyline-lora-blind, skyline-lora-aware, "
                        "sim-lora-blind, sim-lora-aware")
    p.add_argument("--workload", default="mixed", choices=["mixed", "multiturn", "lora"],
                   help="mixed: independent chat and RAG requests (default); multiturn: conversations of several "
                        "turns and RAG questions over shared documents, one system prompt (prefix-cache reuse); "
                        "lora: the mixed requests, each naming one of --adapters LoRA adapters (Zipf popularity)")
    p.add_argument("--adapters", type=int, default=8,
                   help="lora: adapters made at run time from the default model (peft), named by the requests; "
                        "default 8")
    p.add_argument("--zipf", type=float, default=1.0,
                   help="lora: the adapters' Zipf exponent (the i-th most popular has weight 1/i^s; 0 = uniform); "
                        "default 1")
    p.add_argument("--engines", type=int, default=2,
                   help="engines of the N-engine systems (vllm-rr, skyline-affinity, skyline-no-affinity, the *-lora-* "
                        "systems, and their sim- twins), one core each; default 2 (the disagg systems are always 1 "
                        "prefill + 1 decode)")
    p.add_argument("--block-size", type=int, default=0,
                   help="KV block (tokens) of every vLLM engine, the baselines' and Skyline's alike: the prefix "
                        "cache's unit; default 0 = vLLM's (128 on CPU)")
    p.add_argument("--turns", default="3-5", help="multiturn: turns per conversation LO-HI (default 3-5)")
    p.add_argument("--think-s", type=float, default=1.5,
                   help="multiturn: mean think time (s, exponential) between an answer and the next turn; default 1.5")
    p.add_argument("--rag-docs", type=int, default=3,
                   help="multiturn: shared documents the RAG questions are about (default 3)")
    p.add_argument("--max-prompt-tokens", type=int, default=1800,
                   help="multiturn: a conversation ends before a prompt longer than this (default 1800; context 2048)")
    p.add_argument("--rates", help="comma-separated request rates (req/s; multiturn: sessions/s) to sweep")
    p.add_argument("--duration", type=float,
                   help="seconds of arrivals per rate (requests = rate x duration; multiturn: sessions)")
    p.add_argument("--num-requests", type=int, help="requests (multiturn: sessions) per rate (instead of --duration)")
    p.add_argument("--drain", type=float,
                   help="seconds to wait for stragglers after the last send; then they are cancelled")
    p.add_argument("--mix", type=float, default=0.8,
                   help="fraction of chat requests (the rest is RAG); multiturn: of conversations; default 0.8")
    p.add_argument("--chat-prompt", help="chat prompt tokens LO-HI (chat template included); multiturn: of each "
                                         "user message")
    p.add_argument("--rag-prompt", help="RAG prompt tokens LO-HI (keep LO-HI + output under the 2048 context); "
                                        "multiturn: of each shared document's questions")
    p.add_argument("--chat-output", help="chat output tokens LO-HI (exact: ignore_eos); multiturn: per turn")
    p.add_argument("--rag-output", help="RAG output tokens LO-HI")
    p.add_argument("--chat-tier", default="interactive", choices=["interactive", "standard", "batch"])
    p.add_argument("--rag-tier", default="standard", choices=["interactive", "standard", "batch"])
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: < 1 burstier than Poisson, > 1 smoother")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", help="TTFT targets: one number for every class, or chat=MS,rag=MS")
    p.add_argument("--slo-tpot-ms", help="TPOT targets: one number for every class, or chat=MS,rag=MS")
    p.add_argument("--slo-scale", type=float, default=5.0,
                   help="targets not given explicitly = this multiple of each class's unloaded median on the baseline "
                        "(default 5)")
    p.add_argument("--allow-demotion", action="store_true",
                   help="Skyline systems: send x-slo-allow-demotion (a looser tier instead of a 429)")
    p.add_argument("--probe-requests", type=int, help="unloaded requests per class on the baseline")
    p.add_argument("--warmup", type=int, help="warm-up requests per system (one RAG, the rest chat), not measured")
    p.add_argument("--out", help="output folder (default bench-results/<time>)")
    p.add_argument("--quick", action="store_true", help="the < 10 minute preset (fewer rates, shorter runs)")
    p.add_argument("--endpoint", help="bench this running OpenAI-compatible server (base URL) instead of starting systems")
    p.add_argument("--endpoint-flavor", default="skyline", choices=["plain", "priority", "skyline"],
                   help="with --endpoint: send SLO headers (skyline), vLLM's priority field, or nothing")
    p.add_argument("--model", help="with --endpoint: model name to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default="default",
                   help="with --endpoint: 'default' (the default model's), 'bytes' (sim engine) or an HF folder")
    p.add_argument("--skyline-config", help="TOML config file the Skyline systems' gateway and workers start with "
                   "(see deploy/skyline.toml; default: the built-in defaults)")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds a system may take to become ready")
    p.add_argument("--profile-engine", action="store_true",
                   help="after the systems, profile the engine as the colocated systems run it (every core, no KV "
                        "connector) into <out>/engine-profile.json (~2 min): `skyline simulate --trace "
                        "<out>/results.json` then replays the run on the engine of that hour")


def preset(args: argparse.Namespace) -> dict:
    """The preset values for options the user left unset."""
    base = QUICK if args.quick else FULL
    return {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise ValueError(f"bad range {text!r}: expected LO-HI with 0 < LO <= HI")
    return lo_i, hi_i


def parse_per_class(text: str | None) -> dict[str, float]:
    """'800' -> {chat: 800, rag: 800}; 'chat=800,rag=6000' -> as given."""
    if not text:
        return {}
    if "=" not in text:
        return {"chat": float(text), "rag": float(text)}
    out = {}
    for part in text.split(","):
        cls, _, value = part.partition("=")
        if cls.strip() not in ("chat", "rag"):
            raise ValueError(f"unknown request class {cls!r} in {text!r}; expected chat or rag")
        out[cls.strip()] = float(value)
    return out
