"""`skyline.bench.metrics.summarize`, computed with numpy for runs of millions of simulated requests.

The bench's summary makes a dozen Python passes over its records and sorts
Python lists for every percentile: ~13 s for a simulated hour at 1,000
req/s. This one reads every request once (one C-level attribute getter per
request) and does the rest on arrays. The definitions are the bench's, and
`tests/test_simulate_calibration.py` checks that both give the same summary; the
simulator uses this one only above `FAST_ABOVE` requests, so small runs go
through exactly the code measured runs go through.
"""

from __future__ import annotations

from collections import Counter
from operator import attrgetter

import numpy as np

from skyline.bench.metrics import PERCENTILES
from skyline.bench.record import OUTCOMES

FAST_ABOVE = 100_000  # requests per run; below, `skyline.bench.metrics.summarize` itself

_FIELDS = attrgetter("outcome", "attained", "tier", "cls", "output_tokens", "server_prompt_tokens", "prompt_tokens",
                     "ttft_s", "tpot_s", "latency_s", "ttft_target_ms", "tpot_target_ms")


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
    """The same dict as `skyline.bench.metrics.summarize(requests, duration_s)`."""
    n = len(requests)
    cols = list(zip(*map(_FIELDS, requests))) if n else [()] * 12
    outcome, attained, tier, cls, out_tok, server_prompt, prompt, ttft, tpot, lat, ttft_t, tpot_t = cols
    ok = np.fromiter((o == "ok" for o in outcome), bool, n)
    att = np.fromiter(attained, bool, n)
    out_tok = np.fromiter(out_tok, np.int64, n)
    prompt_used = np.fromiter((s or p for s, p in zip(server_prompt, prompt)), np.int64, n)
    ttft = np.fromiter(ttft, float, n) * 1000
    tpot = np.fromiter(tpot, float, n) * 1000
    lat = np.fromiter(lat, float, n) * 1000
    ttft_ok = ok & (ttft <= np.fromiter(ttft_t, float, n))
    tpot_ok = ok & (tpot <= np.fromiter(tpot_t, float, n))
    outcomes = Counter(outcome)
    by_tier, by_cls = Counter(zip(tier, attained)), Counter(zip(cls, attained))
    out_tokens, prompt_tokens = int(out_tok[ok].sum()), int(prompt_used[ok].sum())
    n_ok = int(ok.sum())
    itl = [g for r, good in zip(requests, ok) if good for g in r.itl_s]
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
    }
