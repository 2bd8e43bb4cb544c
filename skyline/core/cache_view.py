"""The fleet's prefix-cache view: which worker's engine holds which blocks, in Redis.

One sorted set per worker (`Keys.kv_cache`): members are block hashes of
Skyline's chain (scheduler/prefix.py), scores when they were stored. The worker
writes it from its engine's KV cache events (`CacheDelta`); the gateway reads
it to place a request where its prefix is cached. It lives in Redis, not in a
gateway, so a restarted or added gateway places requests at once, and several
gateways agree. Bounded twice: at most `max_blocks` members per worker (the
oldest are dropped: a block stored long ago is the likeliest to be evicted
already, and dropping it costs at most a miss), and it expires with the
worker's heartbeat (skyline/core/fleet.py refreshes and deletes it with the
worker's registry entry), so a dead worker's view is gone within the heartbeat TTL.

    redis-cli ZCARD skyline:kvcache:decode-1              # blocks decode-1 holds
    redis-cli ZRANGE skyline:kvcache:decode-1 -5 -1       # the five newest
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from skyline.core.keys import Keys
from skyline.scheduler.prefix import matched_blocks


async def apply(r: aioredis.Redis, keys: Keys, worker_id: str, stored: Sequence[str], removed: Sequence[str],
                cleared: bool, max_blocks: int, ttl_s: float) -> None:
    """Mirror one batch of the engine's cache events into the worker's view, in one round trip."""
    key = keys.kv_cache(worker_id)
    pipe = r.pipeline(transaction=True)  # a reader never sees a cleared view refilled by half
    if cleared:
        pipe.delete(key)
    elif removed:
        pipe.zrem(key, *removed)
    if stored:
        now = int(time.time() * 1000)
        pipe.zadd(key, dict.fromkeys(stored, now))
        pipe.zremrangebyrank(key, 0, -(max_blocks + 1))  # keep the newest `max_blocks`
    pipe.expire(key, _ttl(ttl_s))
    await pipe.execute()


async def matched(r: aioredis.Redis, keys: Keys, worker_ids: Sequence[str], chain: Sequence[str]) -> dict[str, int]:
    """worker -> how many leading blocks of `chain` its view holds, in one round trip."""
    if not chain or not worker_ids:
        return dict.fromkeys(worker_ids, 0)
    pipe = r.pipeline(transaction=False)
    queue_match(pipe, keys, worker_ids, chain)
    return parse_match(worker_ids, chain, await pipe.execute())


def queue_match(pipe, keys: Keys, worker_ids: Sequence[str], chain: Sequence[str]) -> int:
    """Put the reads of `matched` on `pipe` (the gateway sends them with its other reads of the
    request, in one round trip); returns how many replies they take."""
    if not chain:
        return 0
    for w in worker_ids:
        pipe.zmscore(keys.kv_cache(w), list(chain))
    return len(worker_ids)


def parse_match(worker_ids: Sequence[str], chain: Sequence[str], replies: Sequence) -> dict[str, int]:
    """`matched`'s answer from the replies of `queue_match`."""
    if not chain:
        return dict.fromkeys(worker_ids, 0)
    return {w: matched_blocks(chain, {h for h, score in zip(chain, scores or ()) if score is not None})
            for w, scores in zip(worker_ids, replies)}


def _ttl(ttl_s: float) -> int:
    return max(1, int(ttl_s + 0.999))
