"""`skyline bench churn`: requests keep flowing while workers die and Redis restarts.

A sim fleet (Redis with AOF, or without persistence: `--persistence`; gateway;
P prefill + D decode workers as processes) serves N streaming requests sent at
a steady rate while a chaos loop kill -9s a random worker every few seconds and
starts a replacement, and restarts Redis once. Every request then goes in
exactly one column of the ledger:

  completed  the whole output arrived once: the text equals what the sim
             engine generates for that prompt (no gap, no duplicate token);
  migrated   completed, and its decode moved to another worker mid-stream
             (a subset of completed);
  failed     the client got an explicit error (HTTP status or error frame);
  lost       anything else: a wrong or truncated text without an error, or a
             request that never answered. The goal is 0.

Each failure gets a cause (what the client was told: the error's code, e.g.
`redis_state_lost`, `relay_disconnected`, `redis_unavailable`) and the fault
that explains it (Redis down, reconnecting or just back; a worker killed while
the request was alive), and one verdict:

  refused_at_door       503 before anything was queued, while the fault held
                        (Redis down or the relay reconnecting): an explicit
                        refusal, the client may retry at once;
  state_lost            ended by a fault that lost its state: a Redis restart
                        without persistence (`redis_state_lost`), or the same
                        request's workers killed until it became poison;
  could_have_continued  every other failure. With AOF a restart loses nothing
                        and a greedy stream migrates when its worker dies, so
                        the goal with persistence on is 0.

It also reports the extra end-to-end latency of migrated requests over the
median of undisturbed ones (p50 / p99). The sim engine is the point: the run
measures Skyline's own fault handling, with engines cheap enough that a
2-core machine runs a fleet of several workers.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from skyline.tools.bench.client import RequestRecord, stream_completion

from skyline.core.stats import percentile
from skyline.tools.bench.simfleet import SimFleet
from skyline.workers.engines.sim import expected_output

MODEL = "skyline-sim"
OUTAGE_GRACE_S = 10.0  # `[redis] outage_grace_s` (its default): the longest the fleet rides out Redis
SETTLE_S = 3.0  # after the gateway is back: workers re-register, a refusal then is still the restart's

CONFIG = """
[engine]
sim_prefill_base_s = 0.005
sim_prefill_per_token_s = 0.0005
sim_decode_base_s = {decode_step_s}
sim_decode_per_seq_s = 0.001

[worker]
heartbeat_s = 0.5
reclaim_after_s = {reclaim_after_s}
reclaim_interval_s = 0.5
drain_timeout_s = 5.0

[redis]
outage_grace_s = {outage_grace_s}
"""

# Refusals before anything is queued (gateway/dispatch.py): the client retries at once.
DOOR_CODES = frozenset({"redis_unavailable", "relay_unavailable", "no_workers", "not_ready"})
# vLLM's stream error chunk carries the message, not Skyline's code: the cause of an error frame
# is read from the message its writer gave it (gateway/relay.py, workers/decode.py, workers/runtime.py).
FRAME_CAUSES = (
    ("Redis lost", "redis_state_lost"),
    ("output cannot be completed", "redis_state_lost"),
    ("lost its Redis pub/sub connection", "relay_disconnected"),
    ("caught this request up after losing Redis", "relay_disconnected"),
    ("died mid-stream, and", "migration_refused"),
    ("workers in a row", "poison_request"),
    ("did not read the output fast enough", "client_too_slow"),
    ("waited in the queue past its deadline", "deadline_exceeded"),
    ("internal error in", "internal_error"),
)


@dataclass
class ChurnOptions:
    requests: int = 300
    rate: float = 5.0  # requests/s, evenly spaced
    kill_every_s: float = 4.0
    prefill: int = 2
    decode: int = 2
    max_tokens: int = 64
    decode_step_ms: float = 30.0
    reclaim_after_s: float = 2.0
    persistence: str = "aof"  # Redis: "aof" (appendfsync everysec) or "none"
    redis_restart: bool = True  # once, half-way through
    redis_down_s: float = 1.0
    timeout_s: float = 120.0
    seed: int = 0


@dataclass
class Fault:
    """What the chaos loop did; times in seconds since the first request was sent."""

    kind: str  # "kill" or "redis_restart"
    at_s: float  # kill -9 sent / Redis sent SIGTERM
    what: str = ""  # the worker killed
    up_s: float = 0.0  # redis_restart: Redis answers again
    ready_s: float = 0.0  # redis_restart: the gateway's /health is 200 again (relay re-subscribed)


@dataclass
class Sent:
    """One request as the client saw it; times in seconds since the first request was sent."""

    i: int
    sent_s: float
    ended_s: float
    rec: RequestRecord


@dataclass
class Failure:
    i: int
    sent_s: float
    ended_s: float
    status: int
    source: str  # "status" (HTTP error answer) or "frame" (error chunk in the stream)
    cause: str
    fault: str  # "redis down", "redis reconnecting", "after redis restart", "kill -9 <role>", "no fault"
    verdict: str  # "refused_at_door", "state_lost" or "could_have_continued"
    message: str


@dataclass
class Ledger:
    persistence: str = "aof"
    sent: int = 0
    completed: int = 0
    migrated: int = 0
    failed: int = 0
    lost: int = 0
    refused_at_door: int = 0  # of failed
    state_lost: int = 0  # of failed
    could_have_continued: int = 0  # of failed; the goal with persistence on is 0
    by_cause: dict[str, int] = field(default_factory=dict)
    by_fault: dict[str, dict[str, int]] = field(default_factory=dict)  # fault -> cause -> count
    failures: list[Failure] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)
    migrated_extra_latency_p50_s: float = float("nan")
    migrated_extra_latency_p99_s: float = float("nan")
    events: list[str] = field(default_factory=list)  # what the chaos loop did, with times


@dataclass
class Churn:
    ledger: Ledger
    requests: list[Sent]
    faults: list[Fault]


def prompt_of(i: int) -> str:
    return f"Churn request {i}: describe the skyline of a city at dusk, tower by tower."


def reference(i: int, max_tokens: int) -> str:
    """What the sim engine generates for request `i`: the text a client must get."""
    return expected_output(list(prompt_of(i).encode()), max_tokens).decode()


def cause_of(rec: RequestRecord) -> str:
    """What the client was told: the error's code, else the kind its message names."""
    if rec.error_code and not rec.error_code.isdigit():
        return rec.error_code
    for phrase, cause in FRAME_CAUSES:
        if phrase in rec.error:
            return cause
    return f"{rec.status} other"


def attribute(cause: str, source: str, sent_s: float, ended_s: float, faults: list[Fault],
              persistence: str) -> tuple[str, str]:
    """(fault, verdict) of one failure (pure); see the module docstring."""
    at_door = source == "status" and cause in DOOR_CODES
    kills = [f for f in faults if f.kind == "kill" and sent_s <= f.at_s <= ended_s]
    if kills and cause in ("poison_request", "migration_refused"):
        role = kills[-1].what.split("-")[0]
        # Poison: each delivery's worker died, the retry budget is spent. A refused migration: a
        # greedy stream (all of these) should have moved on.
        return f"kill -9 {role}", "state_lost" if cause == "poison_request" else "could_have_continued"
    for f in (f for f in faults if f.kind == "redis_restart"):
        phase = "redis down" if ended_s <= f.up_s else "redis reconnecting" if ended_s <= f.ready_s else \
            "after redis restart"
        if at_door and f.at_s <= ended_s <= f.ready_s + SETTLE_S:
            return phase, "refused_at_door"
        alive = sent_s <= f.ready_s and ended_s >= f.at_s  # in flight or queued while Redis was away
        if not at_door and alive and ended_s <= f.ready_s + OUTAGE_GRACE_S:
            lost_state = cause == "redis_state_lost" and persistence == "none" and sent_s <= f.up_s
            return phase, "state_lost" if lost_state else "could_have_continued"
    if kills:
        return f"kill -9 {kills[-1].what.split('-')[0]}", "could_have_continued"
    return "no fault", "could_have_continued"


def classify(sent: list[Sent], max_tokens: int, faults: list[Fault] = (), persistence: str = "aof") -> Ledger:
    """Put each request in one column and each failure under its cause and fault (pure)."""
    led = Ledger(persistence=persistence, sent=len(sent))
    clean_latencies, migrated = [], []
    for s in sent:
        rec, want = s.rec, reference(s.i, max_tokens)
        if rec.ok and not rec.error and rec.text == want:
            led.completed += 1
            if rec.skyline.get("decode_attempts", 1) > 1:
                led.migrated += 1
                migrated.append(rec.latency_s)
            else:
                clean_latencies.append(rec.latency_s)
        elif rec.error_source in ("status", "frame"):
            # An HTTP error status or an error frame in the stream: the client was told.
            cause = cause_of(rec)
            fault, verdict = attribute(cause, rec.error_source, s.sent_s, s.ended_s, list(faults), persistence)
            led.failed += 1
            setattr(led, verdict, getattr(led, verdict) + 1)
            led.by_cause[cause] = led.by_cause.get(cause, 0) + 1
            causes = led.by_fault.setdefault(fault, {})
            causes[cause] = causes.get(cause, 0) + 1
            led.failures.append(Failure(s.i, round(s.sent_s, 2), round(s.ended_s, 2), rec.status,
                                        rec.error_source, cause, fault, verdict, rec.error[:200]))
        else:
            led.lost += 1
            if len(led.lost_examples) < 5:
                led.lost_examples.append(f"#{s.i}: status={rec.status} error={rec.error[:120]!r} "
                                         f"got {len(rec.text)}/{len(want)} chars")
    if migrated and clean_latencies:
        base = percentile(clean_latencies, 50)
        extra = [lat - base for lat in migrated]
        led.migrated_extra_latency_p50_s = percentile(extra, 50)
        led.migrated_extra_latency_p99_s = percentile(extra, 99)
    return led


async def _gateway_ready(url: str, timeout_s: float = 60.0) -> None:
    """Until the gateway's /health is 200: Redis answers and the relay has re-subscribed."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)


async def _chaos(fleet: SimFleet, opts: ChurnOptions, t0: float, stop: asyncio.Event, faults: list[Fault]) -> None:
    rng = random.Random(opts.seed)
    duration = opts.requests / opts.rate
    restarted = not opts.redis_restart
    spawned = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=opts.kill_every_s)
            return
        except TimeoutError:
            pass
        now = time.monotonic() - t0
        if not restarted and now >= duration / 2:
            restarted = True
            fault = Fault("redis_restart", now)
            await asyncio.to_thread(fleet.stop_redis)
            await asyncio.sleep(opts.redis_down_s)
            await asyncio.to_thread(fleet.start_redis)
            fault.up_s = time.monotonic() - t0
            await _gateway_ready(fleet.url)
            fault.ready_s = time.monotonic() - t0
            faults.append(fault)
            continue
        role = rng.choice(["prefill", "decode"])
        victims = fleet.workers(role)
        if not victims:
            continue
        victim = rng.choice(victims)
        faults.append(Fault("kill", now, victim))
        await asyncio.to_thread(fleet.kill, victim)
        spawned += 1
        fleet.start_worker(f"{role}-r{spawned}", role)
        faults[-1].what = f"{victim} (started {role}-r{spawned})"


def describe(f: Fault) -> str:
    if f.kind == "redis_restart":
        return (f"{f.at_s:6.1f}s redis restart: down, answering at {f.up_s:.1f}s, "
                f"gateway relay back at {f.ready_s:.1f}s")
    return f"{f.at_s:6.1f}s kill -9 {f.what}"


async def _one(client: httpx.AsyncClient, url: str, body: dict, i: int, t0: float) -> Sent:
    sent_s = time.monotonic() - t0
    rec = await stream_completion(client, url, body)
    return Sent(i, sent_s, time.monotonic() - t0, rec)


async def _drive(fleet: SimFleet, opts: ChurnOptions, faults: list[Fault]) -> list[Sent]:
    url = f"{fleet.url}/v1/completions"
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        chaos = asyncio.create_task(_chaos(fleet, opts, t0, stop, faults))
        tasks = []
        for i in range(opts.requests):
            await asyncio.sleep(max(0.0, t0 + i / opts.rate - time.monotonic()))
            body = {"model": MODEL, "prompt": prompt_of(i), "max_tokens": opts.max_tokens, "temperature": 0}
            tasks.append(asyncio.create_task(_one(client, url, body, i, t0)))
        sent = await asyncio.gather(*tasks)
        stop.set()
        await chaos
    return list(sent)


def run(opts: ChurnOptions, workdir: Path | None = None) -> Churn:
    if opts.persistence not in ("aof", "none"):
        raise ValueError(f"persistence must be 'aof' or 'none', not {opts.persistence!r}")
    with tempfile.TemporaryDirectory(prefix="skyline-churn-") as tmp:
        work = workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        fleet = SimFleet(work, CONFIG.format(decode_step_s=opts.decode_step_ms / 1000,
                                             reclaim_after_s=opts.reclaim_after_s, outage_grace_s=OUTAGE_GRACE_S),
                         persistence=opts.persistence)
        faults: list[Fault] = []
        try:
            fleet.start(opts.prefill, opts.decode)
            sent = asyncio.run(_drive(fleet, opts, faults))
        finally:
            fleet.stop()
    led = classify(sent, opts.max_tokens, faults, opts.persistence)
    led.events = [describe(f) for f in faults]
    return Churn(led, sent, faults)


def main(args) -> None:
    opts = ChurnOptions(requests=args.requests, rate=args.rate, kill_every_s=args.kill_every,
                        prefill=args.prefill, decode=args.decode, max_tokens=args.max_tokens,
                        persistence=args.persistence, redis_restart=not args.no_redis_restart, seed=args.seed)
    t0 = time.monotonic()
    churn = run(opts, Path(args.workdir) if args.workdir else None)
    out = {"options": asdict(opts), "ledger": asdict(churn.ledger), "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
