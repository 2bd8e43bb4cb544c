"""Take over the work of workers that died or stalled.

An entry a worker claimed stays in its stage's pending list (PEL) until the
worker acks it. When the worker is killed, that entry would wait forever; the
reaper, run by every live worker of the stage, finds such entries and claims
them for itself.

Why not plain XAUTOCLAIM with an idle time: an entry's idle time is the time
since it was delivered, and a live decode worker legitimately holds an entry
for as long as the generation lasts (minutes for a long answer). Idle time
alone cannot tell a busy worker from a dead one. So the reaper asks the
worker registry (the heartbeat ZSET) who is alive and claims only entries of
consumers silent for `after_s`, and only entries idle at least as long, with
XCLAIM's own min-idle check: when two reapers race for one entry, the first
XCLAIM resets its idle time and the second claims nothing.

Consumers that are gone and hold nothing are removed from the group (never
one with pending entries), so `XINFO CONSUMERS` lists the fleet as it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from skyline.core import messages
from skyline.core.keys import Keys
from skyline.core.streams import Claimed, TierQueues

log = logging.getLogger("skyline.reaper")


@dataclass
class Reclaimed:
    claimed: Claimed
    deliveries: int  # including this one
    previous_owner: str


async def live_workers(r: aioredis.Redis, keys: Keys, within_s: float) -> set[str]:
    """Worker ids that heartbeated within the last `within_s` seconds."""
    members = await r.zrangebyscore(keys.workers, time.time() - within_s, "+inf")
    return {m.decode() if isinstance(m, bytes) else m for m in members}


async def reclaim(queues: TierQueues, after_s: float, limit: int) -> list[Reclaimed]:
    """Claim up to `limit` entries of this stage held by consumers silent for `after_s`."""
    r, group, me = queues.r, queues.group, queues.consumer
    if limit <= 0:
        return []
    live = await live_workers(r, queues.keys, after_s) | {me}
    idle_ms = int(after_s * 1000)
    out: list[Reclaimed] = []
    for tier, key in queues.lanes:
        try:
            pending = await r.xpending_range(key, group, min="-", max="+", count=max(limit * 4, 16), idle=idle_ms)
        except ResponseError:
            if key in queues.holder_of:  # an affinity lane deleted after its worker left
                continue
            raise
        stale = [p for p in pending if _s(p["consumer"]) not in live]
        if not stale:
            continue
        stale = stale[: limit - len(out)]
        owners = {_s(p["message_id"]): (_s(p["consumer"]), int(p["times_delivered"])) for p in stale}
        out += await _take(queues, key, tier, owners, min_idle_ms=idle_ms)
        if len(out) >= limit:
            break
    return out


async def reclaim_previous_life(queues: TierQueues, limit: int) -> list[Reclaimed]:
    """At start: claim (afresh) up to `limit` entries still pending under this worker's own id, left by
    an earlier process with the same id (restarted in place: a container restarted in its pod keeps
    its host name and, often, its pid; an explicit `--worker-id`). No other worker takes them: they
    see the id heartbeat again; and this process holds nothing yet, so every one of them is a
    predecessor's. Their delivery count goes on, so a request that killed the predecessor is
    dead-lettered in time as any other poison request."""
    r, group, me = queues.r, queues.group, queues.consumer
    out: list[Reclaimed] = []
    for tier, key in queues.lanes:
        if len(out) >= limit:
            break
        try:
            pending = await r.xpending_range(key, group, min="-", max="+", count=limit - len(out), consumername=me)
        except ResponseError:
            continue  # no group yet (a lane of a departed worker, deleted): nothing of ours there
        if pending:
            out += await _take(queues, key, tier, {_s(p["message_id"]): (me, int(p["times_delivered"]))
                                                   for p in pending}, min_idle_ms=0)
    return out


async def _take(queues: TierQueues, key: str, tier: str, owners: dict[str, tuple[str, int]],
                min_idle_ms: int) -> list[Reclaimed]:
    """XCLAIM the entries of `owners` (entry id -> (owner, deliveries so far)) for this consumer."""
    r, group = queues.r, queues.group
    out = []
    for entry_id, fields in await r.xclaim(key, group, queues.consumer, min_idle_time=min_idle_ms,
                                           message_ids=list(owners)):
        eid = _s(entry_id)
        owner, delivered = owners.get(eid, ("?", 0))
        if not fields:  # trimmed from the stream while pending: nothing left to run
            await r.xack(key, group, eid)
            log.warning("dropped pending entry %s of %s: no longer in %s", eid, owner, key)
            continue
        claimed = Claimed(key, eid, tier, messages.decode(fields[b"msg"]), int(fields.get(b"prefill_tokens", 0)))
        out.append(Reclaimed(claimed, delivered + 1, owner))
    return out


async def forget_departed(queues: TierQueues, after_s: float) -> list[str]:
    """Remove consumers that are not alive, were idle for `after_s` and hold no entries."""
    r, group = queues.r, queues.group
    live = await live_workers(r, queues.keys, after_s) | {queues.consumer}
    removed = []
    for _tier, key in queues.lanes:
        try:
            consumers = await r.xinfo_consumers(key, group)
        except ResponseError:
            if key in queues.holder_of:  # an affinity lane deleted after its worker left
                continue
            raise
        for c in consumers:
            name = _s(c["name"])
            if name not in live and int(c["pending"]) == 0 and int(c["idle"]) >= after_s * 1000:
                await r.xgroup_delconsumer(key, group, name)
                removed.append(name)
    await _drop_empty_lanes(queues, live)
    return removed


async def _drop_empty_lanes(queues: TierQueues, live: set[str]) -> None:
    """Delete the affinity lanes of departed workers once nothing in them waits or is held: the
    gateway places work only for live workers, so such a lane gets nothing new."""
    r, group = queues.r, queues.group
    by_holder: dict[str, list[str]] = {}
    for key, holder in queues.holder_of.items():
        by_holder.setdefault(holder, []).append(key)
    for holder, lanes in by_holder.items():
        if holder in live:
            continue
        busy = False
        for key in lanes:
            try:
                groups = await r.xinfo_groups(key)
            except ResponseError:
                continue  # gone already
            g = next((g for g in groups if _s(g["name"]) == group), None)
            if g is not None and int(g["pending"]) == 0:
                lag = g.get("lag")
                if lag is None:  # Redis < 7 does not count it: anything after the last delivered entry?
                    lag = len(await r.xrange(key, min=f"({_s(g['last-delivered-id'])}", max="+", count=1))
                busy = busy or int(lag) > 0
            else:
                busy = busy or g is not None
        if not busy:
            await r.delete(*lanes)
            await r.srem(queues.keys.affinity_lanes(queues.stage), holder)
            log.info("removed the affinity lanes of departed worker %s", holder)


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
