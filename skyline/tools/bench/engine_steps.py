"""The engine steps a Skyline system's workers ran during a bench: how many, how long, how big.

Every vLLM worker exports `skyline_worker_engine_step_seconds` {kind} and
`skyline_worker_engine_step_tokens` {kind} (workers/observe.py, from vLLM's
per-iteration details). Read at the end of a system's run, they give the
engine's step time *in the fleet*, next to its step time alone in
`skyline profile`: the difference is what the host costs the engine (the
gateway, Redis, the worker and the load generator on the same cores), the
figure the simulator's `--slowdown` takes.
"""

from __future__ import annotations

import time
import urllib.request

import redis
from prometheus_client.parser import text_string_to_metric_families

from skyline.core.keys import Keys

STEP = "skyline_worker_engine_step_seconds"
TOKENS = "skyline_worker_engine_step_tokens"


def summarize(metrics_text: str) -> dict[str, dict[str, float]]:
    """kind -> {"steps", "mean_ms", "prompt_tokens", "decode_tokens"} (the last two per step, on
    average) from one worker's /metrics text; empty when the engine reports no steps."""
    count: dict[str, float] = {}
    total: dict[str, float] = {}
    tokens: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            kind = sample.labels.get("kind", "")
            if sample.name == f"{STEP}_count":
                count[kind] = sample.value
            elif sample.name == f"{STEP}_sum":
                total[kind] = sample.value
            elif sample.name == f"{TOKENS}_total":
                tokens[(kind, sample.labels.get("token", ""))] = sample.value
    return {kind: {"steps": int(n), "mean_ms": round(1000 * total.get(kind, 0.0) / n, 2),
                   "prompt_tokens": round(tokens.get((kind, "prompt"), 0.0) / n, 1),
                   "decode_tokens": round(tokens.get((kind, "decode"), 0.0) / n, 2)}
            for kind, n in count.items() if n}


def scrape(redis_url: str, key_prefix: str = "skyline", timeout_s: float = 5.0) -> dict[str, dict]:
    """worker id -> its step summary, for every worker heartbeating in this fleet's Redis."""
    keys = Keys(key_prefix)
    r = redis.Redis.from_url(redis_url, socket_timeout=timeout_s)
    try:
        ids = [i.decode() for i in r.zrangebyscore(keys.workers, time.time() - 60, "+inf")]
        out = {}
        for worker_id in ids:
            port = int(r.hget(keys.worker(worker_id), "metrics_port") or 0)
            if not port:
                continue
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
                steps = summarize(resp.read().decode())
            if steps:
                out[worker_id] = steps
        return out
    finally:
        r.close()


def describe(steps: dict[str, dict]) -> str:
    """One line per worker: 'decode 1234 x 45.1 ms (0+2.1 tokens), mixed ...'."""
    lines = []
    for worker_id, kinds in steps.items():
        parts = [f"{k} {v['steps']} x {v['mean_ms']} ms ({v['prompt_tokens']:g}+{v['decode_tokens']:g} tokens)"
                 for k, v in kinds.items()]
        lines.append(f"{worker_id}: " + ", ".join(parts))
    return "; ".join(lines)
