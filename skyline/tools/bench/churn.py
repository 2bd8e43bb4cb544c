"""`skyline bench churn`: requests keep flowing while workers die and Redis restarts.

A sim fleet (Redis with AOF, gateway, P prefill + D decode workers as
processes) serves N streaming requests sent at a steady rate while a chaos
loop kill -9s a random worker every few seconds and starts a replacement, and
restarts Redis once. Every request then goes in exactly one column of the
ledger:

  completed  the whole output arrived once: the text equals what the sim
             engine generates for that prompt (no gap, no duplicate token);
  migrated   completed, and its decode moved to another worker mid-stream
             (a subset of completed);
  failed     the client got an explicit error (HTTP status or error frame);
  lost       anything else: a wrong or truncated text without an error, or a
             request that never answered. The goal is 0.

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
"""


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
    redis_restart: bool = True  # once, half-way through
    redis_down_s: float = 1.0
    timeout_s: float = 120.0
    seed: int = 0


@dataclass
class Ledger:
    sent: int = 0
    completed: int = 0
    migrated: int = 0
    failed: int = 0
    lost: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # error message (first 80 chars) -> count
    lost_examples: list[str] = field(default_factory=list)
    migrated_extra_latency_p50_s: float = float("nan")
    migrated_extra_latency_p99_s: float = float("nan")
    events: list[str] = field(default_factory=list)  # what the chaos loop did, with times


def prompt_of(i: int) -> str:
    return f"Churn request {i}: describe the skyline of a city at dusk, tower by tower."


def classify(records: list[tuple[int, RequestRecord]], max_tokens: int) -> Ledger:
    """Put each request in one column; see the module docstring."""
    led = Ledger(sent=len(records))
    clean_latencies, migrated = [], []
    for i, rec in records:
        want = expected_output(list(prompt_of(i).encode()), max_tokens).decode()
        if rec.ok and not rec.error and rec.text == want:
            led.completed += 1
            if rec.skyline.get("decode_attempts", 1) > 1:
                led.migrated += 1
                migrated.append(rec.latency_s)
            else:
                clean_latencies.append(rec.latency_s)
        elif rec.error_source in ("status", "frame"):
            # An HTTP error status or an error frame in the stream: the client was told.
            led.failed += 1
            key = f"{rec.status} {rec.error[:80]}"
            led.failures[key] = led.failures.get(key, 0) + 1
        else:
            led.lost += 1
            if len(led.lost_examples) < 5:
                led.lost_examples.append(f"#{i}: status={rec.status} error={rec.error[:120]!r} "
                                         f"got {len(rec.text)}/{len(want)} chars")
    if migrated and clean_latencies:
        base = percentile(clean_latencies, 50)
        extra = [lat - base for lat in migrated]
        led.migrated_extra_latency_p50_s = percentile(extra, 50)
        led.migrated_extra_latency_p99_s = percentile(extra, 99)
    return led


async def _chaos(fleet: SimFleet, opts: ChurnOptions, stop: asyncio.Event, log: list[str]) -> None:
    rng = random.Random(opts.seed)
    t0 = time.monotonic()
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
            log.append(f"{now:6.1f}s redis restart ({opts.redis_down_s:g} s down)")
            await asyncio.to_thread(fleet.stop_redis)
            await asyncio.sleep(opts.redis_down_s)
            await asyncio.to_thread(fleet.start_redis)
            continue
        role = rng.choice(["prefill", "decode"])
        victims = fleet.workers(role)
        if not victims:
            continue
        victim = rng.choice(victims)
        await asyncio.to_thread(fleet.kill, victim)
        spawned += 1
        fleet.start_worker(f"{role}-r{spawned}", role)
        log.append(f"{now:6.1f}s kill -9 {victim}, started {role}-r{spawned}")


async def _drive(fleet: SimFleet, opts: ChurnOptions, log: list[str]) -> list[tuple[int, RequestRecord]]:
    url = f"{fleet.url}/v1/completions"
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        chaos = asyncio.create_task(_chaos(fleet, opts, stop, log))
        tasks = []
        t0 = time.monotonic()
        for i in range(opts.requests):
            await asyncio.sleep(max(0.0, t0 + i / opts.rate - time.monotonic()))
            body = {"model": MODEL, "prompt": prompt_of(i), "max_tokens": opts.max_tokens, "temperature": 0}
            tasks.append(asyncio.create_task(stream_completion(client, url, body)))
        records = await asyncio.gather(*tasks)
        stop.set()
        await chaos
    return list(enumerate(records))


def run(opts: ChurnOptions, workdir: Path | None = None) -> Ledger:
    with tempfile.TemporaryDirectory(prefix="skyline-churn-") as tmp:
        work = workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        fleet = SimFleet(work, CONFIG.format(decode_step_s=opts.decode_step_ms / 1000,
                                             reclaim_after_s=opts.reclaim_after_s), persistence="aof")
        log: list[str] = []
        try:
            fleet.start(opts.prefill, opts.decode)
            records = asyncio.run(_drive(fleet, opts, log))
        finally:
            fleet.stop()
    led = classify(records, opts.max_tokens)
    led.events = log
    return led


def main(args) -> None:
    opts = ChurnOptions(requests=args.requests, rate=args.rate, kill_every_s=args.kill_every,
                        prefill=args.prefill, decode=args.decode, max_tokens=args.max_tokens,
                        redis_restart=not args.no_redis_restart, seed=args.seed)
    t0 = time.monotonic()
    led = run(opts, Path(args.workdir) if args.workdir else None)
    out = {"options": asdict(opts), "ledger": asdict(led), "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
