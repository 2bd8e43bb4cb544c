"""Thin async I/O over the tier streams: enqueue, EDF claim, ack.

The policy (which tier to serve next) lives in `skyline.scheduler.edf`; this
module only observes the stream heads and moves entries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from skyline.core import messages
from skyline.core.keys import STAGES, Keys
from skyline.scheduler.decode_room import paced_claim_due
from skyline.scheduler.edf import pick_tier, retry_first, start_by_ms
from skyline.scheduler.prefix import may_claim
from skyline.scheduler.tiers import Tier


@dataclass
class Head:
    """The next entry of one tier, seen without claiming it: the earlier-due of the
    oldest undelivered entries of its stream and of its retry lane (`stream`)."""

    tier: str
    deadline_ms: int
    prompt_tokens: int
    stream: str = ""
    request_id: str = ""
    prefill_tokens: int = 0  # prompt tokens the claimer computes (0: a KV hand-off)
    stage: str = ""  # the stage whose streams it is in


@dataclass
class Claimed:
    """One stream entry this consumer now owns (until it XACKs it)."""

    stream: str
    entry_id: str
    tier: str
    message: messages.Message
    prefill_tokens: int = 0  # what this entry added to the backlog; removed again at ack
    run: Any = None  # what the stage's `take` claimed with the entry (a decode worker: its RunClaim)


# (stream, group, consumer, request id of the head) -> (entry id, fields, what else it claimed) or None
Take = Callable[[str, str, str, str], Awaitable[tuple[str, dict, Any] | None]]
# Seconds a worker waits before claiming a head it found (TierQueues.claim).
Defer = Callable[["Head"], float]


async def defer_claim(wait_s: float, wake: asyncio.Event | None) -> None:
    """Wait `wait_s` before a claim (`Defer`), or until `wake` is set, whichever is first: the worker's
    engine freed step budget meanwhile (workers/held.py `HeldTable.freed`), so it claims now."""
    if wake is None:
        await asyncio.sleep(wait_s)
        return
    wake.clear()  # what set it before this wait is in the state the wait was computed from
    try:
        await asyncio.wait_for(wake.wait(), wait_s)
    except TimeoutError:
        pass


LANES_REFRESH_S = 1.0  # how often a consumer re-reads the affinity lanes and the live workers


def now_ms() -> int:
    return int(time.time() * 1000)


async def ensure_groups(r: aioredis.Redis, keys: Keys, tiers: tuple[str, ...], stage: str | None = None) -> None:
    """Create the consumer groups (and streams) if missing. Idempotent; called at
    start-up and after a Redis restart, since a restarted Redis without
    persistence has neither."""
    for st in STAGES:
        if stage and st != stage:
            continue
        for _tier, key in keys.lanes(st, tiers):
            await _create_group(r, key, Keys.group(st))


async def _create_group(r: aioredis.Redis, key: str, group: str) -> None:
    try:
        await r.xgroup_create(key, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(frozen=True)
class Placement:
    """Work placed for one worker's prefix cache (scheduler/prefix.py): only `worker` may claim it
    before `until_ms` (Unix ms), any worker after, or once `worker` is gone."""

    worker: str
    until_ms: int
    matched_blocks: int = 0


@dataclass(frozen=True)
class Reservation:
    """Prompt tokens admission control added to the backlog of (`stage`, `tier`) before deciding
    (`queue_reservation`); the enqueue turns it into what the entry really adds."""

    stage: str
    tier: str
    tokens: int


async def enqueue(
    r: aioredis.Redis, keys: Keys, stage: str, msg: messages.GenerateRequest | messages.DecodeWork, maxlen: int,
    reserved: Reservation | None = None, retry: bool = False, placement: Placement | None = None,
    prefill_tokens: int | None = None,
) -> str:
    """XADD a request to its tier stream (`retry`: to the tier's retry lane, for work
    returned to the queue; `placement`: to the affinity lane of the worker it names).
    Besides the msgpack body, a few plain fields make `XRANGE` readable for an
    operator. The entry's prefill work is added to the backlog in the same round trip;
    `reserved`: what admission control added already, moved or corrected to that here
    (its request may have been demoted, re-routed, or found partly cached). `prefill_tokens`:
    what its prefill will compute, when the gateway knows its prefix is cached (else the whole
    prompt); the worker takes the same off the backlog at ack."""
    req = msg.request if isinstance(msg, messages.DecodeWork) else msg
    fields = entry_fields(msg)
    if prefill_tokens is not None and fields["prefill_tokens"]:
        fields["prefill_tokens"] = prefill_tokens
    pipe = r.pipeline(transaction=False)
    if placement is not None:
        key = keys.affinity_lane(stage, req.tier, placement.worker)
        fields["affinity"], fields["until_ms"] = placement.worker, placement.until_ms
        # The lane's group first (a no-op answered BUSYGROUP once it exists), listed for the workers.
        pipe.xgroup_create(key, Keys.group(stage), id="0", mkstream=True)
        pipe.sadd(keys.affinity_lanes(stage), placement.worker)
    else:
        key = keys.retry_stream(stage, req.tier) if retry else keys.stream(stage, req.tier)
    pipe.xadd(key, fields, maxlen=maxlen, approximate=True)
    for field, delta in _backlog_moves(reserved, stage, req.tier, fields["prefill_tokens"]):
        pipe.hincrby(keys.backlog, field, delta)
    results = await pipe.execute(raise_on_error=False)
    entry_id = results[2 if placement is not None else 0]
    for result in results:
        if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
            raise result
    return _s(entry_id)


async def open_lanes(r: aioredis.Redis, keys: Keys, stage: str, tiers: Iterable[str], worker_id: str) -> None:
    """Make `worker_id`'s affinity lanes of `stage` (their consumer group) and list them for the
    stage's workers: what must exist before work is placed there, or nobody would read it."""
    pipe = r.pipeline(transaction=False)
    for tier in tiers:
        pipe.xgroup_create(keys.affinity_lane(stage, tier, worker_id), Keys.group(stage), id="0", mkstream=True)
    pipe.sadd(keys.affinity_lanes(stage), worker_id)
    for result in await pipe.execute(raise_on_error=False):
        if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
            raise result


def _backlog_moves(reserved: Reservation | None, stage: str, tier: str, tokens: int) -> list[tuple[str, int]]:
    """The backlog increments that leave (`stage`, `tier`) holding the entry's `tokens`
    in place of what was `reserved` for it."""
    moves: dict[str, int] = {}
    if reserved is not None and reserved.tokens:
        moves[Keys.backlog_field(reserved.stage, reserved.tier)] = -reserved.tokens
    field = Keys.backlog_field(stage, tier)
    moves[field] = moves.get(field, 0) + tokens
    return [(f, d) for f, d in moves.items() if d]


def needs_prefill(msg: messages.Message) -> bool:
    """Does this work still need its prompt computed (anything but decode work carrying a KV handle)?"""
    return not (isinstance(msg, messages.DecodeWork) and msg.kv_handle is not None)


def entry_fields(msg: messages.GenerateRequest | messages.DecodeWork) -> dict:
    """A stream entry: the msgpack body plus a few plain fields that make `XRANGE`
    readable for an operator and let workers peek at heads without decoding."""
    req = msg.request if isinstance(msg, messages.DecodeWork) else msg
    return {
        "id": req.request_id,
        "tier": req.tier,
        "deadline_ms": req.deadline_ms,
        "prompt_tokens": len(req.prompt_token_ids),
        "prefill_tokens": len(req.prompt_token_ids) if needs_prefill(msg) else 0,
        "max_tokens": req.sampling.max_tokens,
        "msg": messages.encode(msg),
    }


async def queued_tokens(r: aioredis.Redis, keys: Keys, stage: str) -> dict[str, int]:
    """tier -> prompt tokens admitted to the stage and not yet prefilled (queued or in progress)."""
    return _backlog_of(await r.hgetall(keys.backlog), stage)


def queue_reservation(pipe, keys: Keys, reserved: Reservation) -> None:
    """Put on `pipe`: add a request's prompt to the backlog, then read the backlog (two replies).

    Admission decides on the read (`backlog_seen`). The two run in this order on one
    connection, so of two concurrent requests at least one sees the other's tokens (the
    later increment comes before the later read): a burst cannot all pass a check made
    before any of them was counted. The caller releases the reservation if it refuses
    the request, and the enqueue settles it (`enqueue`'s `reserved`).
    """
    pipe.hincrby(keys.backlog, Keys.backlog_field(reserved.stage, reserved.tier), reserved.tokens)
    pipe.hgetall(keys.backlog)


def backlog_seen(raw: dict, stage: str, reserved: Reservation | None) -> dict[str, int]:
    """tier -> the backlog of `stage` as read by `queue_reservation`, without the reserving request's own
    tokens."""
    backlog = _backlog_of(raw, stage)
    if reserved is not None and reserved.stage == stage:
        backlog[reserved.tier] = max(0, backlog.get(reserved.tier, 0) - reserved.tokens)
    return backlog


async def release_backlog(r: aioredis.Redis, keys: Keys, stage: str, tier: str, tokens: int) -> None:
    await r.hincrby(keys.backlog, Keys.backlog_field(stage, tier), -tokens)


def _backlog_of(raw: dict, stage: str) -> dict[str, int]:
    prefix = f"{stage}:"
    return {_s(k)[len(prefix):]: max(0, int(v)) for k, v in raw.items() if _s(k).startswith(prefix)}


class TierQueues:
    """One stage's tier streams, and the workers' affinity lanes, seen from one consumer.

    `claim()` waits until some tier has an undelivered entry, picks the tier
    whose head has the earliest deadline (policy: `pick_tier`) and claims one
    entry from it. A tier's head is the earlier-due of its stream's and its
    retry lane's (work returned to the queue with its original deadline), so a
    preempted request comes back ahead of the ones that arrived after it.
    Peeking uses plain XREAD from each group's last-delivered id, which neither
    claims nor changes anything, so idle workers can watch the queues without
    hoarding work another worker could start sooner.

    Affinity lanes (`Keys.affinity_lane`) hold work the gateway placed for one
    worker's prefix cache. Their head counts among a tier's heads for the
    worker it names, and for any other worker once its `until_ms` has passed or
    its worker is gone (scheduler/prefix.py `may_claim`); until then the others
    wait on the lanes they may take from, no longer than that bound.
    """

    def __init__(self, r: aioredis.Redis, keys: Keys, stage: str, tiers: tuple[Tier, ...], consumer: str,
                 liveness_s: float = 5.0):
        self.r = r
        self.keys = keys
        self.stage = stage
        self.group = Keys.group(stage)
        self.tiers = tiers
        self.tier_names = tuple(t.name for t in tiers)
        self.consumer = consumer
        self.liveness_s = liveness_s  # a worker silent this long is gone: its placed work is anyone's
        self.shared_lanes = keys.lanes(stage, self.tier_names)
        self.lanes = list(self.shared_lanes)  # (tier, key): every stream this stage reads, affinity lanes last
        self.tier_of = {key: tier for tier, key in self.lanes}
        self.holder_of: dict[str, str] = {}  # affinity lane -> the worker it is for
        self.retry_lanes = {keys.retry_stream(stage, t) for t in self.tier_names}
        self.live: set[str] = set()
        self.deferred_until_ms = 0  # the earliest bound of a head placed for another worker (0 = none)
        # After a peek: the lanes (key -> last-delivered id) with nothing this consumer may claim yet at
        # their head, to wait on (a lane whose head is placed for another worker is not among them).
        self.open_lanes: dict[str, str] = {}
        self._lanes_read_at = -LANES_REFRESH_S

    async def refresh_lanes(self) -> None:
        """Which workers have affinity lanes, and which workers are alive (at most once per
        LANES_REFRESH_S: a new lane is seen that much late, by a worker it is not for)."""
        if time.monotonic() - self._lanes_read_at < LANES_REFRESH_S:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(self.keys.affinity_lanes(self.stage))
        pipe.zrangebyscore(self.keys.workers, time.time() - self.liveness_s, "+inf")
        holders, live = await pipe.execute()
        self._lanes_read_at = time.monotonic()
        self.live = {_s(w) for w in live} | {self.consumer}
        placed = [(t, self.keys.affinity_lane(self.stage, t, w), w) for w in sorted(map(_s, holders))
                  for t in self.tier_names]
        self.holder_of = {key: w for _t, key, w in placed}
        self.lanes = self.shared_lanes + [(t, key) for t, key, _w in placed]
        self.tier_of = {key: tier for tier, key in self.lanes}

    async def _last_delivered(self) -> dict[str, str]:
        pipe = self.r.pipeline(transaction=False)
        for _tier, key in self.lanes:
            pipe.xinfo_groups(key)
        out: dict[str, str] = {}
        for (_tier, key), groups in zip(self.lanes, await pipe.execute(raise_on_error=False)):
            if isinstance(groups, ResponseError):  # "no such key": Redis restarted without persistence
                groups = []
            last = next((g["last-delivered-id"] for g in groups if _s(g["name"]) == self.group), None)
            if last is None:
                if key in self.holder_of:  # a lane deleted after its worker left, or not made yet
                    continue
                raise ResponseError(f"NOGROUP consumer group {self.group} missing on {key}")
            out[key] = _s(last)
        return out

    async def peek_heads(self, block_ms: int) -> dict[str, Head]:
        """tier -> its next entry this consumer may claim; waits up to `block_ms` for one to
        appear when there is none (0 = do not wait)."""
        await self.refresh_lanes()
        last = await self._last_delivered()
        resp = await self.r.xread(last, count=1, block=block_ms or None)
        heads = self.heads_of((_s(key), fields) for key, entries in resp or [] for _entry_id, fields in entries)
        waiting = {_s(key) for key, _entries in resp or []}
        self.open_lanes = {k: v for k, v in last.items() if k not in waiting}
        if heads or not self.deferred_until_ms or not block_ms:
            return heads
        # Only work placed for other workers is waiting: watch the lanes this consumer may take from,
        # until the first of those bounds passes.
        # Never empty: the shared lanes are always open (a head there is claimable, so none came back).
        timeout = max(1, min(block_ms, self.deferred_until_ms - now_ms()))
        resp = await self.r.xread(self.open_lanes, count=1, block=timeout)
        return self.heads_of((_s(key), fields) for key, entries in resp or [] for _entry_id, fields in entries)

    def heads_of(self, entries) -> dict[str, Head]:
        """tier -> its next entry, from the oldest undelivered entry of each lane: (stream key, fields).
        A head placed for another worker counts only once this consumer may claim it."""
        heads: dict[str, Head] = {}
        self.deferred_until_ms = 0
        now = now_ms()
        for key, fields in entries:
            tier = self.tier_of[key]
            holder = self.holder_of.get(key)
            if holder is not None:
                until = int(fields.get(b"until_ms", 0))
                if not may_claim(self.consumer, holder, now, until, holder in self.live):
                    self.deferred_until_ms = min(self.deferred_until_ms or until, until)
                    continue
            prompt_tokens = int(fields[b"prompt_tokens"])
            head = Head(tier, int(fields[b"deadline_ms"]), prompt_tokens, key, _s(fields.get(b"id", b"")),
                        int(fields.get(b"prefill_tokens", prompt_tokens)), self.stage)
            seen = heads.get(tier)
            if seen is None or self._due_first(head, seen):
                heads[tier] = head
        return heads

    def _due_first(self, a: Head, b: Head) -> bool:
        """Is head `a` served before `b`, the other lane of its tier (scheduler.edf.retry_first)?"""
        if a.stream in self.retry_lanes:
            return retry_first(a.deadline_ms, b.deadline_ms)
        return not retry_first(b.deadline_ms, a.deadline_ms)

    def pick(self, heads: dict[str, Head], tiers: tuple[str, ...] | None = None, tokens_per_s: float = 0.0,
             due_by_ms: int | None = None) -> str | None:
        """The tier to claim from: EDF by latest start over the heads (`pick_tier`, `start_by_ms` at the
        claimer's `tokens_per_s`; 0: by deadline), among `tiers` only if given; with `due_by_ms`, only if
        that head must start by then."""
        keys = {t: start_by_ms(h.deadline_ms, h.prefill_tokens, tokens_per_s)
                for t, h in heads.items() if tiers is None or t in tiers}
        tier = pick_tier(keys, self.tier_names)
        return None if tier is None or (due_by_ms is not None and not paced_claim_due(keys[tier], due_by_ms)) else tier

    async def claim(self, block_ms: int = 1000, tiers: tuple[str, ...] | None = None,
                    take: Take | None = None, defer: Defer | None = None,
                    wake: asyncio.Event | None = None, tokens_per_s: float = 0.0,
                    due_by_ms: int | None = None) -> Claimed | None:
        """Claim the next entry in EDF order by latest start (at `tokens_per_s`, the claimer's measured
        prompt rate; 0: by deadline; among `tiers` only, if given), or None if nothing arrived in
        `block_ms` (or only entries of other tiers are waiting). `due_by_ms`: claim it only if it must
        start by then (what a worker the pace rule holds back may still take).
        `take`: claims the entry with what the stage keeps beside it, in one round trip
        (a decode worker's run: workers/runs.py `Runs.take`); else a plain XREADGROUP.
        `defer`: seconds to wait before claiming a head, for a freer worker to take it first
        (`scheduler.claiming.claim_defer_s`), cut short when `wake` is set (`defer_claim`); the heads
        are read again after the wait."""
        heads = await self.peek_heads(block_ms)
        tier = self.pick(heads, tiers, tokens_per_s, due_by_ms)
        if tier is not None and defer is not None and (wait := defer(heads[tier])) > 0:
            await defer_claim(wait, wake)
            heads = await self.peek_heads(0)
            tier = self.pick(heads, tiers, tokens_per_s, due_by_ms)
        if tier is None:
            return None
        return await self.claim_head(heads[tier], take)

    async def claim_head(self, head: Head, take: Take | None = None) -> Claimed | None:
        """Claim the entry at `head` (a head `peek_heads` found), or None if another worker took it first."""
        tier = head.tier
        if take is not None:
            got = await take(head.stream, self.group, self.consumer, head.request_id)
            if got is None:
                return None  # another worker took it between peek and claim
            entry_id, fields, run = got
        else:
            resp = await self.r.xreadgroup(self.group, self.consumer, {head.stream: ">"}, count=1)
            entries = [e for _key, es in resp or [] for e in es]
            if not entries:
                return None  # another worker took it between peek and claim
            (raw_id, fields), run = entries[0], None
            entry_id = _s(raw_id)
        prefill_tokens = int(fields.get(b"prefill_tokens", 0))
        return Claimed(head.stream, entry_id, tier, messages.decode(fields[b"msg"]), prefill_tokens, run)

    async def release_prefill(self, claimed: Claimed) -> None:
        """The entry's prompt has been computed before its ack (a colocated request
        streams on long after): take it off the backlog now, once."""
        if claimed.prefill_tokens:
            tokens, claimed.prefill_tokens = claimed.prefill_tokens, 0
            await self.r.hincrby(self.keys.backlog, Keys.backlog_field(self.stage, claimed.tier), -tokens)

    async def ack(self, claimed: Claimed) -> bool:
        """Done with an entry (handed on, finished, failed or dropped): XACK it and
        take its prefill work off the backlog. Only the ack that removed the entry
        from the pending list adjusts the backlog: after a takeover both the old
        and the new owner may ack the same entry. False if it was acked already."""
        if not await self.r.xack(claimed.stream, self.group, claimed.entry_id):
            return False
        if claimed.prefill_tokens:
            await self.r.hincrby(self.keys.backlog, Keys.backlog_field(self.stage, claimed.tier), -claimed.prefill_tokens)
        return True


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
