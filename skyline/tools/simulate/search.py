"""`skyline simulate --search`: the cheapest fleet that serves a target rate at >= 90% SLO attainment.

Cheapest = fewest devices (GPUs; a CPU engine counts as one). For the
colocated fleet the answer is the smallest worker count that meets the goal
(doubling, then bisection: attainment grows with workers). For the
disaggregated fleet every prefill:decode split of a device count is tried,
device counts upward from a lower bound, and the first count with a split
that meets the goal is the answer (the split with the best attainment).

The lower bound keeps the search short for large fleets: the prefill pool
must at least keep up with the arriving prompt tokens, the decode pool with
the arriving output tokens, each at its model's throughput with full steps
(one full-budget prefill step; `max_running` sequences per decode step).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from skyline.tools.bench.metrics import SLO_GOAL
from skyline.tools.bench.workload import requests_for
from skyline.tools.simulate.systems import SimSystem, resized
from skyline.tools.simulate.workload import synthetic


def _try(cfg, system: SimSystem, reqs_of, drain: float, tried: list) -> float:
    """Simulate one fleet, note it in `tried` (with its share of 429s), return its attainment."""
    from skyline.tools.simulate.run import simulate_one

    summary, _sim, _wall = simulate_one(cfg, system, reqs_of(), drain)
    tried.append({"fleet": system.fleet.label, "devices": system.devices, "attainment": summary["attainment"],
                  "rejected": summary["rejected"] / max(1, summary["sent"])})
    return summary["attainment"]


def lower_bounds(cfg, system: SimSystem, rate: float, mean_prompt: float, mean_output: float) -> tuple[int, int]:
    """Fewest prefill and decode workers whose throughput covers the offered load."""
    pp, dp = system.perf_prefill, system.perf_decode
    step = pp.max_step_tokens
    prefill_tps = step / pp.prefill_step_s([(0, step)])
    batch = cfg.worker.max_running
    ctx = int(batch * (mean_prompt + mean_output / 2))
    decode_tps = batch / dp.decode_step_s(batch, ctx)
    return max(1, math.ceil(rate * mean_prompt / prefill_tps)), max(1, math.ceil(rate * mean_output / decode_tps))


def search_colocated(cfg, system: SimSystem, reqs_of, drain: float, max_devices: int, tried: list) -> int | None:
    def ok(n: int) -> bool:
        return _try(cfg, resized(system, 0, n), reqs_of, drain, tried) >= SLO_GOAL

    per = system.perf_decode.devices
    lo, hi = 0, 1
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi * per > max_devices:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def search_disagg(cfg, system: SimSystem, reqs_of, drain: float, max_devices: int, bounds: tuple[int, int],
                  tried: list) -> tuple[int, int] | None:
    pd, dd = system.perf_prefill.devices, system.perf_decode.devices
    p_min, d_min = bounds
    for devices in range(p_min * pd + d_min * dd, max_devices + 1):
        best = None
        for p in range(p_min, devices // pd + 1):
            rest = devices - p * pd
            if rest % dd or rest // dd < d_min:
                continue
            d = rest // dd
            att = _try(cfg, resized(system, p, d), reqs_of, drain, tried)
            if att >= SLO_GOAL and (best is None or att > best[2]):
                best = (p, d, att)
        if best:
            return best[0], best[1]
    return None


def shedding_note(tried: list, cfg) -> list[str]:
    """Say so when admission control, not capacity, decides the answer.

    Admission predicts TTFT = backlog ahead / pool rate + `first_token_overhead_ms`,
    and the backlog counts prompts in progress on every worker; a TTFT target
    below that fixed overhead sheds every request that arrives while any
    prompt is being computed, at any fleet size (attainment flat in devices).
    """
    failing = [t for t in tried if t["attainment"] < SLO_GOAL]
    if not failing or not cfg.gateway.admission:
        return []
    shed = sum(t["rejected"] for t in failing) / len(failing)
    missed = sum(1 - t["attainment"] for t in failing) / len(failing)
    if shed < 0.5 * missed:
        return []
    note = (f"Most misses of the fleets that fail are 429s ({shed:.0%} of requests shed, {missed:.0%} missed, "
            f"on average): admission control predicts TTFT with a fixed first-token overhead of "
            f"{cfg.gateway.first_token_overhead_ms:g} ms (gateway.first_token_overhead_ms). If a TTFT target is "
            f"close to or below it, adding GPUs cannot help: size that overhead for these engines (--config) or "
            f"search with --no-admission.")
    return ["", note]


def main(args, cfg, systems: list[SimSystem], spec, targets, preset: dict, drain: float, out: Path,
         command: str) -> None:
    if not args.target_rate:
        raise SystemExit("--search needs --target-rate")
    rate = args.target_rate
    n = requests_for(rate, preset["duration"], args.num_requests)
    reqs_of = lambda: synthetic(spec, rate, n, targets.for_class, args.lengths)
    sample = reqs_of()
    mean_prompt = sum(r.prompt_tokens for r in sample) / len(sample)
    mean_output = sum(r.max_tokens for r in sample) / len(sample)
    answers, tried = {}, []
    for system in systems:
        if system.fleet.mode in ("colocated", "elastic"):  # one pool: only its size to find
            n_workers = search_colocated(cfg, system, reqs_of, drain, args.max_devices, tried)
            answers[system.name] = None if n_workers is None else {
                "fleet": f"{n_workers} {system.fleet.mode}", "devices": n_workers * system.perf_decode.devices}
        else:
            bounds = lower_bounds(cfg, system, rate, mean_prompt, mean_output)
            split = search_disagg(cfg, system, reqs_of, drain, args.max_devices, bounds, tried)
            answers[system.name] = None if split is None else {
                "fleet": f"{split[0]}P+{split[1]}D", "prefill": split[0], "decode": split[1],
                "devices": resized(system, *split).devices, "lower_bound": f"{bounds[0]}P+{bounds[1]}D"}
    lines = ["# skyline simulate --search", "", f"Command: `{command}`", "",
             (f"Target: {rate:g} req/s at >= {SLO_GOAL:.0%} SLO attainment ({n} requests, "
              f"TTFT targets {targets.ttft_ms} ms, TPOT targets {targets.tpot_ms} ms; {targets.source})."), "",
             "| system | cheapest fleet | devices |", "|---|---|---|"]
    for name, a in answers.items():
        lines.append(f"| {name} | {a['fleet'] if a else f'none within {args.max_devices} devices'} | "
                     f"{a['devices'] if a else '-'} |")
    lines += ["", "Fleets tried:", "", "| fleet | devices | attainment | 429s |", "|---|---|---|---|"]
    lines += [f"| {t['fleet']} | {t['devices']} | {t['attainment']:.1%} | {t['rejected']:.1%} |" for t in tried]
    lines += shedding_note(tried, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search.json").write_text(json.dumps({"command": command, "target_rate": rate, "answers": answers,
                                                 "tried": tried, "slo": targets.to_dict()}, indent=1))
    (out / "search.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
