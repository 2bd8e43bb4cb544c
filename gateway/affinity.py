"""Prefix affinity in the gateway: place a request where its prompt's prefix is cached.

The policy is scheduler/prefix.py's; this module gathers what it decides on: the
live workers of the request's stage (the fleet view's heartbeats: load, block
size) and how many leading blocks of the prompt each one's engine holds (the
cache view in Redis, one round trip for all of them). Skipped, at no cost, when
fewer than two workers of the stage report a prefix cache: with one worker the
shared queue reaches the same engine anyway.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from skyline.core import cache_view
from skyline.core.fleet import WorkerInfo
from skyline.core.keys import Keys
from skyline.core.messages import GenerateRequest
from skyline.core.streams import Placement, now_ms
from skyline.scheduler.prefix import AffinityPolicy, Holder, block_chain, place, wait_bound_ms

# A worker whose KV cache is this full would evict to make room: not one to wait for.
KV_FULL = 0.95


async def place_request(policy: AffinityPolicy, max_blocks: int, r: aioredis.Redis, keys: Keys,
                        workers: list[WorkerInfo], stage: str, req: GenerateRequest) -> Placement | None:
    """The worker to place `req` for, with its bound, or None (the shared queue)."""
    if not policy.enabled:
        return None
    candidates = [w for w in workers if w.role == stage and w.cache_block_size]
    if len(candidates) < 2:
        return None
    block_size = candidates[0].cache_block_size  # one model, one block size; others are not comparable
    candidates = [w for w in candidates if w.cache_block_size == block_size]
    chain = block_chain(req.prompt_token_ids, block_size, max_blocks, req.cache_salt or "")
    if not chain:
        return None
    matched = await cache_view.matched(r, keys, [w.worker_id for w in candidates], chain)
    best = place(policy, [Holder(w.worker_id, matched[w.worker_id], overloaded(w)) for w in candidates])
    if best is None:
        return None
    return Placement(best.worker, wait_bound_ms(policy, now_ms(), req.deadline_ms), best.matched_blocks)


def overloaded(w: WorkerInfo) -> bool:
    """Full by its last heartbeat: as many requests as it may hold, or a KV cache about to evict."""
    return (w.max_running > 0 and w.running >= w.max_running) or w.kv_usage >= KV_FULL
