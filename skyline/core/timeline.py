"""Per-request timelines: what happened to a request, when, and where.

Every process that sees something happen to a request (the gateway, a
prefill worker, a decode worker) records it as an event: a name from
`EVENTS`, the wall-clock time in ms, who saw it (gateway or worker id) and a
few fields. The same call also writes one log line (logger
`skyline.events`, structured in `--log-format json`) and tells listeners
(the process's Prometheus metrics) and its OpenTelemetry spans (skyline/core/tracing.py, when
it exports traces) about it, so an event is counted, logged, traced and kept the same way everywhere.

Storage: one Redis LIST per request (`Keys.timeline`), one JSON object per
event, newest `max_events` kept, TTL renewed by every write. Writes are
best-effort and coalesced (`PipelineBatcher`: one pipeline per few ms, one
RPUSH per request in it): recording never delays or fails a request; a lost
write is logged and counted. Readers sort by time (events come from several
processes; clocks of one host agree, hosts should run NTP).

    timeline = Timeline(redis, keys, who="decode-0")
    timeline.emit(request_id, "decode_claimed", tier="standard")      # fire and forget
    await timeline.record(request_id, "migrated", from_worker="decode-1")  # waits for the write
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from skyline.core.batchwrite import PipelineBatcher
from skyline.core.keys import Keys

log = logging.getLogger("skyline.events")

# Event names, in the order a request normally meets them. Fields each usually carries:
EVENTS = (
    "arrived",              # gateway: kind, prompt_tokens, max_tokens, stream, route
    "admitted",             # gateway: decision (admit/demote/reject/overloaded), predicted_ttft_ms, tier
    "enqueued",             # gateway or worker: stage, tier, deadline_ms
    "placed",               # gateway: worker (prefix affinity: the worker it waits for), matched_blocks, wait_ms
    "prefill_claimed",      # prefill or elastic worker: tier, delivery
    "decode_placed",        # elastic worker: on (where it is decoded), why, streams_here (scheduler/elastic.py)
    "prefill_started",      # prefill worker: prompt_tokens
    "prefill_finished",     # prefill worker: ms
    "kv_handle_published",  # prefill worker: stage=decode, handle_bytes
    "decode_claimed",       # decode worker: tier, kv (remote/local)
    "kv_transfer",          # decode worker: ms, bytes (when known), remote_tokens
    "pd_fallback",          # decode worker: reason (the prompt is computed here although a prefill engine had it)
    "first_token",          # decode worker: ttft_ms (from arrival)
    "preempted",            # prefill worker: for_tier (the stricter request it made room for), preemptions
    "requeued",             # worker: stage, tier, reason
    "migrated",             # decode worker that took over a stream: from_worker, tokens_so_far
    "reclaimed",            # worker that took over an abandoned entry: stage, from_worker, idle_ms
    "worker_gave_up",       # worker whose engine died or stopped stepping, leaving the fleet: reason
    "cancelled",            # gateway (reason) or worker (phase: queued/prefill/decode)
    "kv_released",          # decode worker: source_engine (a handed-off prompt's blocks freed unpulled)
    "failed",               # gateway or worker: reason, status, dead_letter
    "finished",             # decode worker: reason, prompt_tokens, completion_tokens
    "responded",            # gateway: status, ttft_ms, tpot_ms, e2e_ms, slo_met (the client's view)
)
_KNOWN = frozenset(EVENTS)

Listener = Callable[[str, dict[str, Any]], None]


@dataclass
class TimelineEvent:
    event: str
    # Unix epoch milliseconds, to the microsecond: events of different processes within the
    # same millisecond still sort in the order they happened (one host, one clock).
    t_ms: float
    who: str  # gateway or worker id
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        # Not `asdict`: its deep copy of `fields` cost more than the encoding (several events a request).
        return json.dumps({"event": self.event, "t_ms": self.t_ms, "who": self.who, "fields": self.fields},
                          separators=(",", ":"), default=str)

    @staticmethod
    def from_json(raw: bytes | str) -> TimelineEvent:
        d = json.loads(raw)
        return TimelineEvent(str(d["event"]), float(d["t_ms"]), str(d.get("who", "")), dict(d.get("fields") or {}))


class EventLine:
    """A log message that renders as `event request_id=.. worker=.. k=v ...` in text logs
    and is unpacked field by field by the JSON formatter (skyline/core/logs.py)."""

    __slots__ = ("event", "request_id", "worker", "fields")

    def __init__(self, event: str, request_id: str, worker: str, fields: dict[str, Any]):
        self.event, self.request_id, self.worker, self.fields = event, request_id, worker, fields

    def as_dict(self) -> dict[str, Any]:
        return {"event": self.event, "request_id": self.request_id, "worker": self.worker, **self.fields}

    def __str__(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.fields.items())
        return f"{self.event} request_id={self.request_id} worker={self.worker}" + (f" {extra}" if extra else "")


def now_ms() -> float:
    """Wall-clock Unix time in ms, to the microsecond."""
    return round(time.time() * 1000, 3)


def key_digest(api_key: str, secret: bytes) -> str:
    """The owner the gateway records for what `api_key` creates (a request's timeline, files,
    batches; gateway/tenants.py), never the key itself: HMAC-SHA256 under the fleet's owner
    secret. Keyed, not a plain hash: anyone who reads Redis (a worker host, a dump, an ACL user
    with read access) could test guesses of a weak key against a plain SHA-256 offline; with
    the HMAC they also need the secret, which only the gateways hold."""
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


class Timeline:
    """Records request events for one process (`who`). See the module docstring."""

    def __init__(self, r: Any, keys: Keys, who: str, ttl_s: int = 3600, max_events: int = 256,
                 enabled: bool = True, log_events: bool = True):
        self.keys = keys
        self.who = who
        self.ttl_s = max(1, int(ttl_s))
        self.max_events = max(1, int(max_events))
        self.enabled = enabled
        self.log_events = log_events
        self.listeners: list[Listener] = []  # called with (event, fields) for every event, e.g. metrics
        self.traces: Any = None  # skyline.core.tracing.RequestTraces, when the process exports traces
        self.batcher = PipelineBatcher(r, "timeline")
        self._warned: set[str] = set()
        self._pending: dict[str, list[str]] = {}  # timeline key -> events not yet handed to the batcher

    @property
    def errors(self) -> int:
        """Events lost because Redis did not take them."""
        return self.batcher.dropped

    def emit(self, request_id: str, event: str, *, t_ms: float | None = None, who: str | None = None,
             **fields: Any) -> None:
        """Record `event` now (or at `t_ms`): Redis (written within this loop turn), log, listeners.
        Never raises and never waits."""
        if event not in _KNOWN and event not in self._warned:
            self._warned.add(event)
            log.warning("timeline event %r is not one of skyline.core.timeline.EVENTS; recorded anyway", event)
        who = who or self.who
        for listener in self.listeners:
            try:
                listener(event, fields)
            except Exception:  # noqa: BLE001 - a metrics bug must not fail a request
                log.exception("timeline listener failed on %s", event)
        if self.log_events and log.isEnabledFor(logging.INFO):
            log.info(EventLine(event, request_id, who, fields))
        t_ms = now_ms() if t_ms is None else t_ms
        if self.traces is not None:
            try:
                self.traces.on_event(request_id, event, t_ms, fields)
            except Exception:  # noqa: BLE001 - a tracing bug must not fail a request
                log.exception("tracing %s failed", event)
        if not self.enabled:
            return
        entry = TimelineEvent(event, t_ms, who, fields).to_json()
        if not self._pending:
            self.batcher.add(self._write_pending)
        self._pending.setdefault(self.keys.timeline(request_id), []).append(entry)

    def _write_pending(self, pipe: Any) -> int:
        """Every pending event: one RPUSH, LTRIM and EXPIRE per request."""
        pending, self._pending = self._pending, {}
        for key, entries in pending.items():
            pipe.rpush(key, *entries)
            pipe.ltrim(key, -self.max_events, -1)
            pipe.expire(key, self.ttl_s)
        return sum(map(len, pending.values()))

    async def record(self, request_id: str, event: str, *, t_ms: float | None = None, who: str | None = None,
                     **fields: Any) -> None:
        """`emit`, then wait until the event was written (or the write failed). Never raises."""
        self.emit(request_id, event, t_ms=t_ms, who=who, **fields)
        await self.flush()

    def set_requester(self, request_id: str, owner: str) -> None:
        """Remember who sent the request (`owner`: `key_digest` of its API key), for the owner-only
        timeline route."""
        if not self.enabled:
            return
        key, ttl = self.keys.requester(request_id), self.ttl_s
        self.batcher.add(lambda pipe: pipe.set(key, owner, ex=ttl))

    async def flush(self) -> None:
        await self.batcher.flush()


async def read_timeline(r: Any, keys: Keys, request_id: str) -> list[TimelineEvent]:
    """The request's events in time order (empty when unknown or expired). Entries
    that do not parse (written by something else) are skipped."""
    events = []
    for raw in await r.lrange(keys.timeline(request_id), 0, -1):
        try:
            events.append(TimelineEvent.from_json(raw))
        except (ValueError, KeyError, TypeError):
            continue
    events.sort(key=lambda e: e.t_ms)  # stable: events of one process keep their order on a tie
    return events


async def requester_of(r: Any, keys: Keys, request_id: str) -> str | None:
    raw = await r.get(keys.requester(request_id))
    return raw.decode() if isinstance(raw, bytes) else raw


# (phase, starts at, ends at): each end event closes the latest start before it, so a
# preempted request's prefill counts every attempt. "event:stage" matches only events
# whose `stage` field is that stage.
PHASES = (
    ("queued for prefill", ("enqueued:prefill", "requeued:prefill"), "prefill_claimed"),
    ("prefill", ("prefill_started",), "prefill_finished"),
    ("hand-off to decode", ("kv_handle_published",), "decode_claimed"),
    ("queued for decode", ("enqueued:decode", "requeued:decode"), "decode_claimed"),
    ("decode until first token", ("decode_claimed",), "first_token"),
    ("time to first token", ("arrived",), "first_token"),
    ("decode", ("first_token",), "finished"),
    ("end to end", ("arrived",), "responded"),
)


def phase_durations(events: list[TimelineEvent]) -> list[dict]:
    """[{phase, ms, count, who}] for every phase the events contain (pure)."""
    out = []
    for name, starts, end in PHASES:
        total, count, who = 0, 0, []
        start: TimelineEvent | None = None
        for e in events:
            if e.event in starts or f"{e.event}:{e.fields.get('stage')}" in starts:
                start = e
            elif e.event == end and start is not None:
                total += e.t_ms - start.t_ms
                count += 1
                if e.who not in who:
                    who.append(e.who)
                start = None
        if count:
            out.append({"phase": name, "ms": round(total, 1), "count": count, "who": who})
    return out


class TimelineErrors(Collector):
    """`skyline_timeline_write_errors_total`: events lost because Redis did not take them
    (read from the process's recorder at scrape time; recording never fails a request)."""

    def __init__(self, dropped: Callable[[], int]):
        self.dropped = dropped

    def collect(self):
        c = CounterMetricFamily("skyline_timeline_write_errors", "Timeline events and SLO records lost to Redis errors")
        c.add_metric([], self.dropped())
        yield c
