"""Riding out a Redis outage: retry a write for a bounded time instead of failing the request.

Unretried, a Redis restart (or failover, or a dropped connection) fails every
request a worker holds at its next Redis call. With persistence on, the
request's state survives the restart, so the worker only has to wait for
Redis and carry on. The calls retried here are safe to repeat: frames are
applied once by their number, the hand-off once per request, an ack or a
claim again is harmless (workers/runs.py). Past `bound_s` the error is
raised as before and the request fails visibly.

redis-py's own retry (skyline/core/redisconn.py, ~0.35 s) covers a broken
pooled connection, not a server that is down for seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("skyline.worker.outage")

T = TypeVar("T")

# What a Redis that is down or restarting looks like. BusyLoadingError (LOADING: the AOF is
# being read back) is a ConnectionError in redis-py.
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 0.5  # a restart is noticed within half a second of Redis answering again


async def ride_out(call: Callable[[], Awaitable[T]], bound_s: float, what: str) -> T:
    """`await call()`, retried while Redis is unreachable, for up to `bound_s` seconds of wall
    time (pauses doubling from FIRST_BACKOFF_S to MAX_BACKOFF_S); then its error is raised."""
    t0 = time.monotonic()
    pause = FIRST_BACKOFF_S
    warned = False
    while True:
        try:
            result = await call()
        except RETRYABLE as exc:
            left = t0 + bound_s - time.monotonic()
            if left <= 0:
                if warned:
                    log.error("%s: Redis still unreachable after %.1f s: %s", what, time.monotonic() - t0, exc)
                raise
            if not warned:
                log.warning("%s: Redis unreachable (%s); retrying for up to %.1f s", what, exc, bound_s)
                warned = True
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, MAX_BACKOFF_S)
            continue
        if warned:
            log.info("%s: Redis answered again after %.1f s", what, time.monotonic() - t0)
        return result
