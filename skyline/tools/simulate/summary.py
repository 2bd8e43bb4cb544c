"""`skyline.tools.bench.metrics.summarize`, computed with numpy for runs of millions of simulated requests.

The bench's summary makes a dozen Python passes over its records and sorts
Python lists for every percentile: slow for the millions of requests of a
simulated hour. This one reads each attribute with C-level iteration (map +
attrgetter, no Python frame per request) and does the rest on arrays. The definitions are the bench's, and
`tests/test_simulate_calibration.py` checks that both give the same summary; the
simulator uses this one only above `FAST_ABOVE` requests, so small runs go
through exactly the code measured runs go through.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, compress
from operator import attrgetter

import numpy as np

from skyline.tools.bench.metrics import PERCENTILES
from skyline.tools.bench.record import OUTCOMES

FAST_ABOVE = 100_000  # requests per run; below, `skyline.tools.bench.metrics.summarize` itself


def _stats(ms: np.ndarray) -> dict:
    if not len(ms):
        return {"mean": float("nan"), **{f"p{q}": float("nan") for q in PERCENTILES}}
    qs = np.percentile(ms, PERCENTILES)  # linear interpolation, as bench.client.percentile
    return {"mean": float(ms.mean()), **{f"p{q}": float(v) for q, v in zip(PERCENTILES, qs)}}


def _attainment(counts: Counter, key) -> dict:
    sent = counts[(key, True)] + counts[(key, False)]
    hit = counts[(key, True)]
    return {"attained": hit, "attainment": hit / sent if sent else float("nan"), "sent": sent}


def summarize(requests, duration_s: float) -> dict:
    """The same dict as `skyline.tools.bench.metrics.summarize(requests, duration_s)`."""
    n = len(requests)

    def column(name: str, dtype=None):
        """One attribute of every request, read by C-level iteration (map + attrgetter)."""
        values = map(attrgetter(name), requests)
        return np.fromiter(values, dtype, n) if dtype is not None else list(values)

    outcome, tier, cls, attained = column("outcome"), column("tier"), column("cls"), column("attained")
    ok_list = list(map("ok".__eq__, outcome))
    ok = np.fromiter(ok_list, bool, n)
    att = np.fromiter(attained, bool, n)
    out_tok = column("output_tokens", np.int64)
    server_prompt, prompt = column("server_prompt_tokens", np.int64), column("prompt_tokens", np.int64)
    prompt_used = np.where(server_prompt != 0, server_prompt, prompt)  # the bench's `server or requested`
    ttft = column("ttft_s", float) * 1000
    tpot = column("tpot_s", float) * 1000
    lat = column("latency_s", float) * 1000
    ttft_ok = ok & (ttft <= column("ttft_target_ms", float))
    tpot_ok = ok & (tpot <= column("tpot_target_ms", float))
    outcomes = Counter(outcome)
    by_tier, by_cls = Counter(zip(tier, attained)), Counter(zip(cls, attained))
    out_tokens, prompt_tokens = int(out_tok[ok].sum()), int(prompt_used[ok].sum())
    n_ok = int(ok.sum())
    itl = list(chain.from_iterable(compress(map(attrgetter("itl_s"), requests), ok_list)))
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    hit = int(att.sum())
    return {
        "sent": n,
        **{o: outcomes[o] for o in OUTCOMES},
        "attained": hit,
        "attainment": hit / n if n else float("nan"),
        "attainment_ttft": float(ttft_ok.sum()) / n if n else float("nan"),
        "attainment_tpot": float(tpot_ok.sum()) / n if n else float("nan"),
        "by_tier": {t: _attainment(by_tier, t) for t in sorted(set(tier))},
        "by_class": {c: _attainment(by_cls, c) for c in sorted(set(cls))},
        "duration_s": duration_s,
        "request_throughput": per_s(n_ok),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + prompt_tokens),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_ms": _stats(ttft[ok]),
        "tpot_ms": _stats(tpot[ok & (out_tok > 1)]),
        "itl_ms": _stats(np.asarray(itl, float) * 1000),
        "e2e_ms": _stats(lat[ok]),
        "prefix_cache": _prefix_cache(column("cached_tokens", np.int64)[ok], prompt_used[ok]),
        "routes": _routes(list(compress(column("route"), ok_list)), list(compress(column("turn"), ok_list))),
    }


def _routes(route: list[str], turn: list) -> dict:
    """`metrics.routes` of the completed requests' routes and turns (None: not a session's)."""
    def count(pairs: Counter) -> dict[str, int]:
        return {r: pairs[r] for r in ("colocated", "disagg")}

    if not route:
        return {}
    later = Counter(r for r, t in zip(route, turn) if t)
    return {**count(Counter(route)), "later_turns": count(later)}


def _prefix_cache(cached: np.ndarray, prompt: np.ndarray) -> dict:
    """`metrics.prefix_cache` of simulated requests: their cached tokens are known (a replayed
    trace's, else 0), an oracle's are not (the simulator keeps no token ids)."""
    total = int(prompt.sum())
    hit = int(cached.sum())
    nan = float("nan")
    return {"hit_rate": hit / total if total else nan, "oracle_hit_rate": nan, "of_oracle": nan,
            "cached_tokens": hit, "prompt_tokens": total, "oracle_cached_tokens": 0}
