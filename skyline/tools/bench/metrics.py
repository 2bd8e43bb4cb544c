"""Summaries of benchmark records: latency percentiles, throughput, SLO attainment, goodput (pure).

Definitions match `vllm bench serve` (see `skyline.tools.bench.record`):
percentiles (linear interpolation, numpy's default) are over completed (ok)
requests; ITL percentiles pool every gap of every completed request; TPOT
percentiles are over completed requests with more than one output token.
Throughputs divide by the run's duration (first send to last completion, or
to the drain deadline) and count completed requests only; total tok/s adds
their prompt tokens to their output tokens.

SLO attainment divides attained requests by *all* requests sent: a rejected
(429), failed or cancelled request did not meet its SLO.
"""

from __future__ import annotations

from typing import Callable, Iterable

from skyline.core.stats import percentile
from skyline.tools.bench.record import OUTCOMES, BenchRecord

SLO_GOAL = 0.9  # goodput = highest rate at which at least this fraction attains (DistServe uses 90%)
PERCENTILES = (50, 90, 99)


def latency_stats(values_s: list[float]) -> dict:
    """mean and p50/p90/p99 in milliseconds (NaN when there are no values)."""
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else float("nan")}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return out


def _attainment(records: list[BenchRecord]) -> dict:
    n = len(records)
    hit = sum(r.attained for r in records)
    return {"sent": n, "attained": hit, "attainment": hit / n if n else float("nan")}


def _share(records: list[BenchRecord], pred: Callable[[BenchRecord], bool]) -> float:
    return sum(map(pred, records)) / len(records) if records else float("nan")


def _hit_rate(records: list[BenchRecord], cached: Callable[[BenchRecord], int | None]) -> tuple[float, int, int]:
    """(cached / prompt tokens, cached, prompt) over the records for which `cached` is known."""
    known = [(c, r.server_prompt_tokens or r.prompt_tokens) for r in records if (c := cached(r)) is not None]
    hit, prompt = sum(c for c, _ in known), sum(p for _, p in known)
    return (hit / prompt if prompt else float("nan")), hit, prompt


def prefix_cache(ok: list[BenchRecord]) -> dict:
    """The prefix-cache hit rate the server reported, the oracle's (one infinite cache, `oracle.py`)
    and their ratio, over completed requests. NaN where nobody said (a server that reports no cached
    tokens; a workload without the oracle). The ratio is over the requests whose hits were reported:
    a disaggregated fleet reports none for a prompt the prefill pool computed, and its hits over the
    rest against the oracle over all would mix two sets (and can pass 100%)."""
    rate, hit, prompt = _hit_rate(ok, lambda r: r.cached_tokens)
    orate, ohit, _ = _hit_rate(ok, lambda r: r.oracle_cached_tokens)
    _, same, _ = _hit_rate([r for r in ok if r.cached_tokens is not None], lambda r: r.oracle_cached_tokens)
    return {"hit_rate": rate, "oracle_hit_rate": orate,
            "of_oracle": hit / same if same > 0 else float("nan"),
            "cached_tokens": hit, "prompt_tokens": prompt, "oracle_cached_tokens": ohit}


def routes(ok: list[BenchRecord]) -> dict:
    """Where a Skyline fleet computed the completed prompts (the gateway's `skyline.route`): `colocated`
    on the decode worker, skipping the prefill pool; `disagg` through it. Again for the later turns of
    conversations (turn >= 1): those whose history the decode worker holds may skip it however long
    they are. {} where the server does not say (not Skyline)."""
    said = [r for r in ok if r.skyline.get("route")]
    if not said:
        return {}

    def count(recs: list[BenchRecord]) -> dict[str, int]:
        return {route: sum(r.skyline["route"] == route for r in recs) for route in ("colocated", "disagg")}

    return {**count(said), "later_turns": count([r for r in said if (r.turn or 0) >= 1])}  # (simulated: None)


def summarize(records: list[BenchRecord], duration_s: float) -> dict:
    """The summary of one system at one rate."""
    ok = [r for r in records if r.outcome == "ok"]
    counts = {o: sum(r.outcome == o for r in records) for o in OUTCOMES}
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.server_prompt_tokens or r.prompt_tokens for r in ok)
    n = len(records)
    return {
        "sent": n,
        **counts,
        **{k: v for k, v in _attainment(records).items() if k != "sent"},
        # Which half of the SLO failed: a system can meet TTFT and lose on TPOT, or the reverse.
        "attainment_ttft": _share(records, lambda r: r.outcome == "ok" and r.ttft_s * 1000 <= r.ttft_target_ms),
        "attainment_tpot": _share(records, lambda r: r.outcome == "ok" and r.tpot_s * 1000 <= r.tpot_target_ms),
        "by_tier": {t: _attainment([r for r in records if r.tier == t]) for t in sorted({r.tier for r in records})},
        "by_class": {c: _attainment([r for r in records if r.cls == c]) for c in sorted({r.cls for r in records})},
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration_s if duration_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_ms": latency_stats([r.ttft_s for r in ok]),
        "tpot_ms": latency_stats([r.tpot_s for r in ok if r.output_tokens > 1]),
        "itl_ms": latency_stats([g for r in ok for g in r.itl_s]),
        "e2e_ms": latency_stats([r.latency_s for r in ok]),
        "prefix_cache": prefix_cache(ok),
        "routes": routes(ok),
    }


def goodput(points: Iterable[tuple[float, float]], goal: float = SLO_GOAL) -> dict:
    """Highest request rate whose SLO attainment is >= `goal`, from a sweep of (rate, attainment).

    Walks the rates upward and stops at the first one below the goal: the
    goodput is where the line between that rate and the one before it crosses
    the goal (linear interpolation). Stopping at the first crossing (rather
    than taking any later rate that happens to recover) reports the rate up
    to which the system *reliably* meets the goal, which is what capacity
    planning needs. Returns {"rps", "bound"} with bound:
      "interpolated"       the crossing lies between two measured rates;
      "at_least"           every rate met the goal: rps is the highest measured;
      "below_lowest_rate"  even the lowest rate missed: rps is None.
    """
    pts = sorted(points)
    if not pts:
        return {"rps": None, "bound": "no_data", "goal": goal}
    if pts[0][1] < goal:
        return {"rps": None, "bound": "below_lowest_rate", "lowest_rate": pts[0][0], "goal": goal}
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < goal:
            rps = r0 + (a0 - goal) / (a0 - a1) * (r1 - r0)
            return {"rps": rps, "bound": "interpolated", "goal": goal}
    return {"rps": pts[-1][0], "bound": "at_least", "goal": goal}


def format_goodput(g: dict) -> str:
    if g["bound"] == "interpolated":
        return f"{g['rps']:.2f}"
    if g["bound"] == "at_least":
        return f">= {g['rps']:.2f}"
    if g["bound"] == "below_lowest_rate":
        return f"< {g['lowest_rate']:.2f}"
    return "n/a"
