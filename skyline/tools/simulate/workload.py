"""Simulated requests: the bench's workload definition, the ShareGPT-like lengths, or a trace.

Synthetic workloads reuse `skyline.tools.bench.workload`: the same `WorkloadSpec`,
the same arrival process and random stream (`arrival_offsets` seeded as
`make_requests` seeds it, so a simulated rate sends at exactly the times the
benchmark sends; beyond 200,000 requests per rate numpy draws the same
process) and the same class sequence (`class_sequence`). Lengths are
token counts drawn from the spec's ranges (the bench builds text of those
lengths; the simulator needs only the counts), with numpy, because an hour at
1,000 req/s is 3.6 million requests.

ShareGPT-like lengths (`--lengths sharegpt`, the DistServe check): prompt
tokens lognormal with median 550 and sigma 0.75 (mean ~700: multi-turn
conversations as prompts, as DistServe prepares ShareGPT), output tokens
lognormal with median 160 and sigma 0.75 (mean ~200), at least 4 tokens
each, prompt + output < 2048 (OPT's context; DistServe drops longer
conversations). `sharegpt=` overrides these (the check's sensitivity table).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np

from skyline.tools.bench.workload import WorkloadSpec, arrival_offsets, class_sequence
from skyline.tools.simulate.request import SimRequest

EXACT_ARRIVALS = 200_000  # up to this many requests per rate, the benchmark's own send times (random.Random)
SHAREGPT = {"prompt_median": 550, "output_median": 160, "sigma": 0.75, "max_total": 2048}


def _lengths(spec: WorkloadSpec, classes: list[str], rng: np.random.Generator, lengths: str,
             sharegpt: dict | None = None) -> tuple:
    n = len(classes)
    if lengths == "sharegpt":
        sg = {**SHAREGPT, **(sharegpt or {})}
        p = np.exp(rng.normal(math.log(sg["prompt_median"]), sg["sigma"], n))
        o = np.exp(rng.normal(math.log(sg["output_median"]), sg["sigma"], n))
        p = np.clip(np.rint(p), 4, sg["max_total"] - 8).astype(int)
        o = np.clip(np.rint(o), 4, None).astype(int)
        o = np.minimum(o, sg["max_total"] - 1 - p)
        return p.tolist(), o.tolist()
    if lengths != "bench":
        raise ValueError(f"unknown length distribution {lengths!r}; expected bench or sharegpt")
    is_chat = np.array([c == "chat" for c in classes])
    draw = lambda lo_hi: rng.integers(lo_hi[0], lo_hi[1] + 1, n)
    prompts = np.where(is_chat, draw(spec.chat_prompt), draw(spec.rag_prompt))
    outputs = np.where(is_chat, draw(spec.chat_output), draw(spec.rag_output))
    return prompts.tolist(), outputs.tolist()


def synthetic(spec: WorkloadSpec, rate: float, n: int, targets, lengths: str = "bench",
              sharegpt: dict | None = None) -> list[SimRequest]:
    """The first `n` requests at `rate`; `targets(cls)` -> (TTFT ms, TPOT ms) the client asks for."""
    if n <= EXACT_ARRIVALS:
        times = arrival_offsets(n, rate, random.Random(f"{spec.seed}:arrivals:{rate:g}"), spec.arrival,
                                spec.burstiness)
    else:  # the same process from numpy's generator, drawn as arrays: millions of draws one by one are slow
        arrival_offsets(1, rate, random.Random(0), spec.arrival, spec.burstiness)  # validates the arguments
        shape = 1.0 if spec.arrival == "poisson" else spec.burstiness
        gaps = np.random.default_rng([spec.seed, 11, round(rate * 1000)]).gamma(shape, 1.0 / (rate * shape), n)
        gaps[0] = 0.0
        times = np.cumsum(gaps).tolist()
    phase = random.Random(f"{spec.seed}:content:{rate:g}").random()
    classes = class_sequence(n, spec.mix, phase)
    prompts, outputs = _lengths(spec, classes, np.random.default_rng([spec.seed, round(rate * 1000)]), lengths, sharegpt)
    by_cls = {c: (spec.tier_of(c), *targets(c)) for c in ("chat", "rag")}
    out = []
    for i, (t, cls, p, o) in enumerate(zip(times, classes, prompts, outputs)):
        tier, ttft, tpot = by_cls[cls]
        out.append(SimRequest(i, cls, tier, t, p, o, ttft, tpot))
    return out


def probe(spec: WorkloadSpec, per_class: int, lengths: str = "bench") -> list[SimRequest]:
    """Requests of each class for the unloaded probe (no targets: the tier's defaults apply)."""
    out = []
    for cls in ("chat", "rag"):
        rng = np.random.default_rng([spec.seed, 7, len(out)])
        prompts, outputs = _lengths(spec, [cls] * per_class, rng, lengths)
        for p, o in zip(prompts, outputs):
            out.append(SimRequest(len(out), cls, spec.tier_of(cls), 0.0, p, o, math.inf, math.inf))
    return out


def measured_cache_hit(record: dict) -> int:
    """Prompt tokens the engine that computed a measured request found in its prefix cache (vLLM's
    `num_cached_tokens`; for a prompt prefilled remotely, the prefill engine's count: the decode
    engine's counts the transferred KV). A JSON-lines trace may give "cached_tokens" itself."""
    if "cached_tokens" in record:
        return int(record["cached_tokens"])
    kv = (record.get("skyline") or {}).get("kv_transfer") or {}
    return int((kv.get("prefill_cached_tokens") if kv.get("remote_prefill") else kv.get("num_cached_tokens")) or 0)


def load_trace(path: str | Path, system: str | None = None, cache_hits: bool = False,
               block_size: int = 0) -> tuple[dict[float, list[SimRequest]], dict]:
    """Requests per rate from a trace, and what the trace says about itself.

    A `skyline bench` results.json: the records of one system (the first by
    default), with their prompt and output lengths, send times and SLO
    targets: a measured run replayed exactly. Or JSON lines, one request
    each: {"send_at": s, "prompt_tokens": n, "max_tokens": n} and optionally
    "cls", "tier", "rate", "ttft_target_ms", "tpot_target_ms", "cached_tokens".

    `cache_hits`: each request's engine skips the prompt tokens it found in
    its prefix cache when measured (`measured_cache_hit`). Off by default: on
    the CPU fleets the simulator is calibrated against, its other omission,
    the host's load on the engines' steps, about cancels it, and the
    calibration was made without it (docs/simulator.md).

    `block_size` (the engines' KV block): a multi-turn run's requests get their prefix identity
    (`sessions.attach_chains`: system prompt, history, documents), so simulated prefix caches and
    placement decide their hits; each keeps its measured oracle hit for the report.
    """
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "records" in doc:
        systems = [s for s in doc["config"]["systems"] if any(r["system"] == s for r in doc["records"])]
        chosen = system or systems[0]
        rows = [r for r in doc["records"] if r["system"] == chosen]
        if not rows:
            raise ValueError(f"no records of system {chosen!r} in {path}; systems: {systems}")
        meta = {"source": f"{path} (records of {chosen})", "system": chosen, "slo": doc.get("slo"),
                "workload": doc["config"].get("workload"), "drain_s": doc["config"].get("drain_s")}
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        meta = {"source": str(path), "system": None, "slo": None, "workload": None, "drain_s": None}
    by_rate: dict[float, list[SimRequest]] = {}
    rows_of: dict[float, list[dict]] = {}
    for r in rows:
        rate = float(r.get("rate", 0.0))
        prompt = int(r.get("server_prompt_tokens") or r["prompt_tokens"])
        reqs = by_rate.setdefault(rate, [])
        cls = r.get("cls", "chat")
        req = SimRequest(int(r.get("index", len(reqs))), cls, r.get("tier", "standard"), float(r["send_at"]),
                         prompt, int(r["max_tokens"]), float(r.get("ttft_target_ms", math.inf)),
                         float(r.get("tpot_target_ms", math.inf)))
        if cache_hits:
            req.cached_tokens = min(prompt - 1, measured_cache_hit(r))
        req.oracle_cached_tokens = r.get("oracle_cached_tokens")
        reqs.append(req)
        rows_of.setdefault(rate, []).append(r)
    multiturn = (meta["workload"] or {}).get("kind") == "multiturn" and all("session" in r for r in rows)
    for rate, reqs in by_rate.items():
        if block_size and multiturn:
            from skyline.tools.simulate.sessions import attach_chains

            attach_chains(rows_of[rate], reqs, meta["workload"], rate, block_size)
        reqs.sort(key=lambda q: (q.send_at, q.index))
    return by_rate, meta
