"""What a role's handler may use of its worker (workers/prefill.py, workers/decode.py).

A handler gets the request it serves as a `HeldRequest` (workers/held.py) and the
worker's services through this port, not the whole runtime: the engine, the run
state in Redis, the timeline and meters, and the worker's ways to end a request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.core.timeline import Timeline
from skyline.scheduler.decode_room import TokenPaceMeter
from skyline.scheduler.throughput import ThroughputMeter
from skyline.workers.engines.base import Engine
from skyline.workers.held import HeldRequest
from skyline.workers.runs import Runs


class Fail(Protocol):
    def __call__(self, held: HeldRequest, status: int, message: str, code: str | None = None,
                 dead_letter: bool = True, detail: str | None = None) -> Awaitable[None]: ...


@dataclass(frozen=True)
class WorkerPort:
    cfg: SkylineConfig
    worker_id: str
    keys: Keys
    redis: aioredis.Redis
    engine: Engine
    runs: Runs
    timeline: Timeline
    meter: ThroughputMeter  # prompt tokens per busy second of the prompts computed here
    pace: TokenPaceMeter  # time per output token of the streams decoded here
    fail: Fail  # end with an error frame, dead-letter it, ack it
    ack: Callable[[HeldRequest], Awaitable[None]]  # XACK, ridden out while Redis is away
    release_prefill: Callable[[HeldRequest], Awaitable[None]]  # its prompt is no longer backlog ahead of anyone
    is_alive: Callable[[str], Awaitable[bool]]  # did that worker heartbeat recently?
    on_start: list[Callable[[], None]]  # hooks run inside the event loop once the worker starts
