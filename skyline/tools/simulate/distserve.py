"""The DistServe check: per-GPU goodput of colocated vs disaggregated serving, OPT-13B on A100s.

DistServe (Zhong et al., OSDI 2024) serves OPT-13B on A100-80GB with the
ShareGPT chatbot workload under TTFT 0.25 s / TPOT 0.1 s and reports the
highest request rate per GPU at which >= 90% of requests meet both, against
vLLM on the same GPUs. Its OPT-13B placement is prefill TP=2 + decode TP=1
(3 GPUs, KV over NVLink inside a node); vLLM runs one TP=1 engine per GPU
(their evaluation scripts). Here both fleets run on the roofline model of
the A100 preset with OPT-13B's shape:

  colocated      1 worker x 1 GPU: prefill and decode share the engine; a
                 step holds up to 16,384 tokens (vLLM's max-num-batched-tokens
                 in DistServe's vLLM launch), so a prefill stalls the batch;
  disaggregated  1 prefill worker (TP=2) + 1 decode worker (TP=1), KV over NVLink.

Both run without admission control (nothing is shed: the paper's systems
queue everything), without the decode workers' TPOT pace rule (neither
system has one) and with up to 256 running sequences per engine.
Goodput per fleet is `skyline.tools.bench.metrics.goodput` over a rate sweep.
"""

from __future__ import annotations

from skyline.core.config import load_config
from skyline.tools.bench import metrics
from skyline.tools.bench.workload import WorkloadSpec
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.roofline import roofline
from skyline.tools.simulate.workload import synthetic

TTFT_MS, TPOT_MS = 250, 100
VLLM_STEP_TOKENS = 16384
# The paper's figures (see docs/simulator.md): chatbot OPT-13B..175B, DistServe vs vLLM request rate.
PAPER_CHATBOT_GAIN = (2.0, 4.6)


def fleet_goodput(fleet: FleetSpec, perf_prefill, perf_decode, rates: list[float], requests: int,
                  seed: int, sharegpt: dict | None, min_remote_prefill_tokens: int = 0,
                  duration_s: float | None = None, stop_below: float = 0.5) -> tuple[dict, list[tuple[float, float]]]:
    """Goodput over a sweep of `rates`, stopping at the first rate attaining under `stop_below`: `requests`
    per rate, or `duration_s` of arrivals. `min_remote_prefill_tokens` 0: the paper disaggregates every prompt."""
    cfg = with_overrides(load_config(None), admission=False, max_running=256,
                         min_remote_prefill_tokens=min_remote_prefill_tokens, tpot_headroom=0.0)
    spec = WorkloadSpec(mix=1.0, chat_tier="interactive", seed=seed)
    points = []
    for rate in rates:
        n = requests if duration_s is None else round(rate * duration_s)
        reqs = synthetic(spec, rate, n, lambda _c: (TTFT_MS, TPOT_MS), "sharegpt", sharegpt)
        sim = Simulation(cfg, fleet, perf_prefill, perf_decode)
        duration = sim.run(reqs, drain_s=120.0)
        att = metrics.summarize(reqs, duration)["attainment"]
        points.append((rate, att))
        if att < stop_below:  # far past the knee: higher rates only cost time
            break
    return metrics.goodput(points), points


def check(requests: int = 600, seed: int = 0, sharegpt: dict | None = None) -> dict:
    """Per-GPU goodput of both fleets and the gain; also the sweeps behind them.

    `sharegpt` overrides the length distribution (see skyline/tools/simulate/workload.py)."""
    colo = roofline("A100", "opt-13b", tp=1, max_step_tokens=VLLM_STEP_TOKENS)
    prefill = roofline("A100", "opt-13b", tp=2, kv_link="nvlink")
    decode = roofline("A100", "opt-13b", tp=1, kv_link="nvlink")
    rates = [round(0.25 * 1.15 ** i, 3) for i in range(40)]
    out = {}
    for name, fleet, pp, dp in (("colocated", FleetSpec("colocated", 0, 1), colo, colo),
                                ("disagg", FleetSpec("disagg", 1, 1), prefill, decode)):
        g, points = fleet_goodput(fleet, pp, dp, rates, requests, seed, sharegpt)
        gpus = fleet.devices(pp, dp)
        out[name] = {"fleet": fleet.label, "gpus": gpus, "goodput_rps": g["rps"], "bound": g["bound"],
                     "per_gpu_rps": (g["rps"] or 0.0) / gpus, "sweep": points}
    out["gain"] = out["disagg"]["per_gpu_rps"] / out["colocated"]["per_gpu_rps"] if out["colocated"]["per_gpu_rps"] \
        else float("inf")
    return out


def markdown(result: dict) -> str:
    c, d = result["colocated"], result["disagg"]
    return "\n".join([
        "| fleet (OPT-13B, A100 roofline) | GPUs | goodput (req/s) | per GPU (req/s) |",
        "|---|---|---|---|",
        f"| colocated (vLLM-like, TP=1) | {c['gpus']} | {c['goodput_rps']:.2f} | {c['per_gpu_rps']:.2f} |",
        f"| disaggregated (prefill TP=2 + decode TP=1) | {d['gpus']} | {d['goodput_rps']:.2f} | {d['per_gpu_rps']:.2f} |",
        (f"| **gain per GPU** | | | **{result['gain']:.1f}x** (paper, chatbot: "
         f"{PAPER_CHATBOT_GAIN[0]:g}-{PAPER_CHATBOT_GAIN[1]:g}x) |"),
    ])


def sensitivity(sigmas=(0.6, 0.75, 0.9), requests: int = 600) -> list[tuple[float, dict]]:
    """The gain as the prompt-length tail grows (same medians): TP=2 prefill serves long prompts within
    the TTFT target that one TP=1 engine cannot, so the heavier the tail, the larger the gain."""
    return [(s, check(requests, sharegpt={"sigma": s})) for s in sigmas]


if __name__ == "__main__":
    print(markdown(check()))
    print()
    print("| prompt/output sigma | colocated per GPU | disagg per GPU | gain |")
    print("|---|---|---|---|")
    for sigma, r in sensitivity():
        print(f"| {sigma:g} | {r['colocated']['per_gpu_rps']:.2f} | {r['disagg']['per_gpu_rps']:.2f} | "
              f"{r['gain']:.1f}x |")
