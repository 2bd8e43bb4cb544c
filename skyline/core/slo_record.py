"""The fleet's recent SLO record in Redis: per-minute counters and the latest finished requests.

Every gateway adds each answered request to two places (one pipelined,
best-effort write, see `PipelineBatcher`):
  - `Keys.slo_minute(m)`: HINCRBY `<tier>:done`, `<tier>:met`, `<tier>:ttft_met`,
    `<tier>:errors` — attainment per minute and tier, summed over gateways — and the same
    per model, `m:<model>:<tier>:<verdict>` (the served name of the request's base model; with
    several models through one gateway, each one's attainment);
  - `Keys.recent`: a capped list of `Outcome`s (latencies, verdict), newest first,
    for percentiles and the slowest requests.
Attainment follows `skyline.tools.bench.metrics`: met / all answered requests of the tier,
so a refused (429/503), failed or cancelled request counts as missed.
Readers (`skyline status`, /dashboard) use the pure summaries below.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from skyline.core.keys import Keys
from skyline.core.stats import percentile

VERDICT_FIELDS = ("done", "met", "ttft_met", "errors")
MODEL_FIELD = "m:"  # a model's counters: m:<model>:<tier>:<verdict> (a model's name may hold ':', a tier's not)


@dataclass
class Outcome:
    """One answered request as the gateway saw it."""

    id: str
    tier: str
    t_ms: int  # when the answer ended (Unix ms)
    status: int  # HTTP status (499: the client left)
    slo_met: bool
    ttft_met: bool = False  # the TTFT half of the SLO alone (which half failed?)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    route: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""  # the served name of its base model ("": not known, e.g. an outcome written before)

    @property
    def ok(self) -> bool:
        return self.status == 200


def minute_of(t_ms: float) -> int:
    return int(t_ms // 60_000)


class SloRecorder:
    """Adds outcomes to the rolling record through a `PipelineBatcher`: the outcomes of one
    flush become one HINCRBY per counter and one LPUSH, however many requests they are."""

    def __init__(self, batcher: Any, keys: Keys, window_minutes: int, keep: int):
        self.batcher = batcher
        self.keys = keys
        self.ttl_s = window_minutes * 60 + 120  # the minute itself, plus slack for slow readers
        self.keep = keep
        self._counts: dict[tuple[str, str], int] = {}
        self._entries: list[str] = []

    def add(self, o: Outcome, in_recent: bool = True) -> None:
        """Count `o` in its minute; list it among the recent requests unless `in_recent` is False."""
        if not self._counts and not self._entries:
            self.batcher.add(self._write)
        key = self.keys.slo_minute(minute_of(o.t_ms))
        prefixes = (f"{o.tier}:", f"{MODEL_FIELD}{o.model}:{o.tier}:") if o.model else (f"{o.tier}:",)
        for name, n in (("done", 1), ("met", o.slo_met), ("ttft_met", o.ttft_met), ("errors", not o.ok)):
            for prefix in prefixes if n else ():
                self._counts[(key, prefix + name)] = self._counts.get((key, prefix + name), 0) + int(n)
        if in_recent:
            self._entries.append(json.dumps(asdict(o), separators=(",", ":")))

    def _write(self, pipe: Any) -> int:
        counts, entries = self._counts, self._entries
        self._counts, self._entries = {}, []
        for (key, name), n in counts.items():
            pipe.hincrby(key, name, n)
        for key in {key for key, _ in counts}:
            pipe.expire(key, self.ttl_s)
        if entries:
            pipe.lpush(self.keys.recent, *entries)  # oldest first, so the newest ends up at the head
            pipe.ltrim(self.keys.recent, 0, self.keep - 1)
        return max(1, len(entries))


async def read_minutes(r: Any, keys: Keys, now_ms: int, minutes: int) -> list[dict]:
    """[{minute, tiers: {tier: {done, met, ttft_met, errors}}, models: {model: {tier: {...}}}}] for the last
    `minutes`, oldest first."""
    last = minute_of(now_ms)
    first = last - minutes + 1
    pipe = r.pipeline(transaction=False)
    for m in range(first, last + 1):
        pipe.hgetall(keys.slo_minute(m))
    out = []
    for m, raw in zip(range(first, last + 1), await pipe.execute()):
        tiers: dict[str, dict[str, int]] = {}
        models: dict[str, dict[str, dict[str, int]]] = {}
        for k, v in (raw or {}).items():
            tier, _, name = _s(k).rpartition(":")
            if name not in VERDICT_FIELDS:
                continue
            into = tiers
            if tier.startswith(MODEL_FIELD):
                model, _, tier = tier[len(MODEL_FIELD):].rpartition(":")
                into = models.setdefault(model, {})
            into.setdefault(tier, dict.fromkeys(VERDICT_FIELDS, 0))[name] = int(v)
        out.append({"minute": m, "tiers": tiers, "models": models})
    return out


async def read_recent(r: Any, keys: Keys, n: int) -> list[Outcome]:
    out = []
    for raw in await r.lrange(keys.recent, 0, max(0, n - 1)):
        try:
            out.append(Outcome(**json.loads(raw)))
        except (ValueError, TypeError):
            continue
    return out


def attainment(minutes: list[dict], tier: str | None = None, model: str | None = None) -> dict:
    """Totals over `minutes` (one tier, or all; one model's, or the fleet's): {done, met, ttft_met, errors,
    attainment}."""
    tot = dict.fromkeys(VERDICT_FIELDS, 0)
    for m in minutes:
        for t, counts in (m["tiers"] if model is None else m.get("models", {}).get(model, {})).items():
            if tier is None or t == tier:
                for k in VERDICT_FIELDS:
                    tot[k] += counts.get(k, 0)
    return {**tot, "attainment": tot["met"] / tot["done"] if tot["done"] else None}


def latency_percentiles(outcomes: list[Outcome], qs: tuple[int, ...] = (50, 90, 99)) -> dict:
    """{ttft_ms: {p50..}, tpot_ms: {...}, e2e_ms: {...}, n} over successful requests (None when empty)."""
    ok = [o for o in outcomes if o.ok]
    out: dict[str, Any] = {"n": len(ok)}
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = [getattr(o, name) for o in ok if getattr(o, name) is not None]
        out[name] = {f"p{q}": (percentile(values, q) if values else None) for q in qs}
    return out


def by_minute(outcomes: list[Outcome], now_ms: int, minutes: int) -> list[dict]:
    """Latency percentiles per minute for the last `minutes`, oldest first."""
    last = minute_of(now_ms)
    buckets: dict[int, list[Outcome]] = {m: [] for m in range(last - minutes + 1, last + 1)}
    for o in outcomes:
        if minute_of(o.t_ms) in buckets:
            buckets[minute_of(o.t_ms)].append(o)
    return [{"minute": m, **latency_percentiles(os)} for m, os in buckets.items()]


def slowest(outcomes: list[Outcome], n: int, since_ms: int) -> list[Outcome]:
    """The `n` requests with the longest end-to-end time since `since_ms` (errors included)."""
    recent = [o for o in outcomes if o.t_ms >= since_ms and o.e2e_ms is not None]
    return sorted(recent, key=lambda o: o.e2e_ms or 0.0, reverse=True)[:n]


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
