"""A worker's side task: mirror its engine's prefix-cache events into the fleet's cache view.

The gateway places a request by prefix (gateway/affinity.py) from that view
(skyline/core/cache_view.py). A batch that cannot be written is not retried: the
view is cleared at the next write and rebuilt from what is stored after it. It
then lacks blocks the engine holds (a missed placement), but never lists a block
the engine evicted while Redis was away.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from skyline.core import cache_view
from skyline.core.config import WorkerConfig
from skyline.core.keys import Keys
from skyline.workers.engines.base import Engine

log = logging.getLogger("skyline.worker")

PERIOD_S = 0.05  # how often the engine's cache events are mirrored into Redis (one pipeline)


async def mirror_cache(engine: Engine, r: aioredis.Redis, keys: Keys, worker_id: str, wc: WorkerConfig) -> None:
    lost = False
    while True:
        await asyncio.sleep(PERIOD_S)
        delta = engine.cache_delta()
        if delta is None and not lost:
            continue
        stored, removed, cleared = (delta.stored, delta.removed, delta.cleared) if delta else ([], [], False)
        try:
            await cache_view.apply(r, keys, worker_id, stored, removed, cleared or lost,
                                   wc.cache_view_max_blocks, wc.heartbeat_ttl_s)
            lost = False
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
            if not lost:
                log.warning("cache view not updated (%s); it is rebuilt once Redis answers", exc)
            lost = True
