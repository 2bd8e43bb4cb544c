"""Tier streams against a real redis-server: exactly-once claims and EDF order; the affinity
lanes (placed work: its holder's first, anyone's after the bound) and the cache view."""

import asyncio

import pytest
import redis.asyncio as aioredis

from skyline.core import cache_view
from skyline.core import messages as m
from skyline.core.keys import Keys
from skyline.core.fleet import WorkerInfo, heartbeat
from skyline.core.stage_queues import StageQueues
from skyline.core.streams import Placement, TierQueues, enqueue, ensure_groups, now_ms
from skyline.scheduler.tiers import DEFAULT_TIERS
from skyline.workers.reaper import forget_departed

TIERS = tuple(t.name for t in DEFAULT_TIERS)


def request(rid: str, tier: str = "standard", deadline_ms: int = 0) -> m.GenerateRequest:
    return m.GenerateRequest(rid, "sim", [1, 2, 3], m.SamplingSpec(), tier, 0, deadline_ms, 1000, 100)


@pytest.fixture
async def r(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_two_competing_consumers_get_each_request_exactly_once(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "prefill")
    ids = [f"req-{i}" for i in range(60)]
    for i, rid in enumerate(ids):
        await enqueue(r, keys, "prefill", request(rid, TIERS[i % 3], deadline_ms=i), maxlen=1000)

    async def drain(consumer: str) -> list[str]:
        q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, consumer)
        got = []
        while (c := await q.claim(block_ms=100)) is not None or len(got) == 0:
            if c is None:
                continue
            got.append(c.message.request_id)
            await q.ack(c)
            await asyncio.sleep(0)  # let the other consumer interleave
        return got

    a, b = await asyncio.gather(drain("worker-a"), drain("worker-b"))
    assert sorted(a + b) == sorted(ids)
    assert len(set(a) & set(b)) == 0
    assert a and b, "both consumers should have received work"


async def test_claims_follow_earliest_deadline_across_tiers(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "prefill")
    # Arrival order differs from deadline order: a batch request queued long ago
    # can be due before a fresh interactive one.
    await enqueue(r, keys, "prefill", request("batch-old", "batch", deadline_ms=100), 1000)
    await enqueue(r, keys, "prefill", request("std", "standard", deadline_ms=500), 1000)
    await enqueue(r, keys, "prefill", request("inter", "interactive", deadline_ms=300), 1000)
    await enqueue(r, keys, "prefill", request("batch-new", "batch", deadline_ms=900), 1000)
    q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, "w")
    order = []
    while (c := await q.claim(block_ms=50)) is not None:
        order.append(c.message.request_id)
        await q.ack(c)
    assert order == ["batch-old", "inter", "std", "batch-new"]


def sized(rid: str, tier: str, deadline_ms: int, prompt_tokens: int) -> m.GenerateRequest:
    return m.GenerateRequest(rid, "sim", list(range(1, prompt_tokens + 1)), m.SamplingSpec(), tier, 0, deadline_ms,
                             1000, 100)


async def _order(q, **claim) -> list[str]:
    order = []
    while (c := await q.claim(block_ms=50, **claim)) is not None:
        order.append(c.message.request_id)
        await q.ack(c)
    return order


async def test_claims_follow_the_latest_start_at_the_claimers_rate(r, key_prefix):
    # A 1,500-token RAG prompt due at 7.1 s must start by 2.1 s at 300 tokens/s; a 150-token chat due at
    # 2.574 s by 2.074 s, one due at 2.7 s by 2.2 s. By deadline both chats would go first.
    for stage, prefix in (("prefill", key_prefix), ("decode", key_prefix + "d")):
        keys = Keys(prefix)
        await ensure_groups(r, keys, TIERS, stage)
        await enqueue(r, keys, stage, sized("rag", "standard", 7_100, 1_500), 1000)
        await enqueue(r, keys, stage, sized("chat", "interactive", 2_574, 150), 1000)
        await enqueue(r, keys, stage, sized("chat-2", "interactive", 2_700, 150), 1000)
    by_start = TierQueues(r, Keys(key_prefix), "prefill", DEFAULT_TIERS, "w")
    assert await _order(by_start, tokens_per_s=300.0) == ["chat", "rag", "chat-2"]
    by_deadline = TierQueues(r, Keys(key_prefix + "d"), "decode", DEFAULT_TIERS, "w")
    assert await _order(by_deadline) == ["chat", "chat-2", "rag"]  # no rate measured: by deadline


async def test_an_elastic_worker_orders_both_stages_by_latest_start(r, key_prefix):
    keys = Keys(key_prefix)
    for stage in ("prefill", "decode"):
        await ensure_groups(r, keys, TIERS, stage)
    await enqueue(r, keys, "prefill", sized("rag", "standard", 7_100, 1_500), 1000)
    await enqueue(r, keys, "decode", sized("chat", "interactive", 2_574, 150), 1000)
    await enqueue(r, keys, "decode", sized("chat-2", "interactive", 2_700, 150), 1000)
    q = StageQueues({s: TierQueues(r, keys, s, DEFAULT_TIERS, "w") for s in ("prefill", "decode")})
    assert await _order(q, tokens_per_s=300.0) == ["chat", "rag", "chat-2"]


async def test_a_claim_due_by_a_time_takes_only_a_head_that_must_start_by_then(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "prefill")
    await enqueue(r, keys, "prefill", sized("rag", "standard", 7_100, 1_500), 1000)
    q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, "w")
    assert await q.claim(block_ms=0, tokens_per_s=300.0, due_by_ms=2_099) is None  # it may start at 2.1 s
    c = await q.claim(block_ms=0, tokens_per_s=300.0, due_by_ms=2_100)
    assert c is not None and c.message.request_id == "rag"


async def test_an_elastic_worker_leaves_heads_to_its_peers_only_until_they_must_start(r, key_prefix):
    # `leave` (scheduler/claiming.py leaves_until_due) passes over a head it leaves, whatever its order, and
    # takes the next; it is told whether the head's latest start has come (it then claims it but for one
    # case: a long engine computing a long prompt leaves a short prompt even then).
    keys = Keys(key_prefix)
    for stage in ("prefill", "decode"):
        await ensure_groups(r, keys, TIERS, stage)
    t = now_ms()
    await enqueue(r, keys, "decode", sized("chat", "interactive", t + 60_000, 150), 1000)  # first by latest start
    await enqueue(r, keys, "prefill", sized("rag", "standard", t + 120_000, 1_500), 1000)
    await enqueue(r, keys, "decode", sized("late", "batch", t - 1, 150), 1000)  # must start now
    q = StageQueues({s: TierQueues(r, keys, s, DEFAULT_TIERS, "w") for s in ("prefill", "decode")})
    left: list[tuple[str, str]] = []

    def leave_chats(stage: str, head, start_by_ms: int, due: bool) -> bool:
        assert due == (start_by_ms <= now_ms())  # asked with the head's latest start and whether it has come
        left.append((stage, head.request_id, due))
        return stage == "decode" and not due

    assert await _order(q, tokens_per_s=300.0, leave=leave_chats) == ["late", "rag"]
    assert ("decode", "chat", False) in left and ("decode", "late", True) in left
    assert await _order(q, tokens_per_s=300.0) == ["chat"]

    # A head left even once due stays where it is.
    await enqueue(r, keys, "decode", sized("late-2", "batch", t - 1, 150), 1000)
    assert await _order(q, tokens_per_s=300.0, leave=lambda stage, head, start_by_ms, due: True) == []
    assert await _order(q, tokens_per_s=300.0) == ["late-2"]


async def test_work_returned_to_the_queue_comes_back_before_what_arrived_after_it(r, key_prefix):
    """A preempted request goes to its tier's retry lane with its original deadline: it is
    claimed before the tier's newer entries, and EDF across tiers still sees its deadline."""
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "prefill")
    for rid, deadline in (("std-a", 100), ("std-b", 200), ("std-c", 300)):
        await enqueue(r, keys, "prefill", request(rid, "standard", deadline), 1000)
    await enqueue(r, keys, "prefill", request("inter", "interactive", 150), 1000)
    q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, "w")
    first = await q.claim(block_ms=10)
    assert first.message.request_id == "std-a"
    # Preempted: re-added with its deadline, the old entry acked (workers/runtime.py).
    await enqueue(r, keys, "prefill", first.message, 1000, retry=True)
    await q.ack(first)
    heads = await q.peek_heads(block_ms=10)
    assert heads["standard"].deadline_ms == 100 and heads["standard"].stream == keys.retry_stream("prefill", "standard")
    order = []
    while (c := await q.claim(block_ms=10)) is not None:
        order.append(c.message.request_id)
        assert c.tier == c.message.tier  # the retry lane's entries keep their tier (backlog accounting)
        await q.ack(c)
    assert order == ["std-a", "inter", "std-b", "std-c"]
    assert await r.xlen(keys.retry_stream("prefill", "standard")) == 1


async def test_idle_claim_waits_and_wakes_on_new_work(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "decode")
    q = TierQueues(r, keys, "decode", DEFAULT_TIERS, "w")
    assert await q.claim(block_ms=50) is None

    async def later():
        await asyncio.sleep(0.2)
        await enqueue(r, keys, "decode", m.DecodeWork(request("late", "interactive", 5)), 1000)

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.create_task(later())
    c = await q.claim(block_ms=3000)
    await task
    assert c is not None and c.message.request.request_id == "late"
    assert loop.time() - t0 < 2.0, "a blocked claim should wake as soon as work arrives"


async def test_peeking_does_not_claim(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "prefill")
    await enqueue(r, keys, "prefill", request("x", "interactive", 1), 1000)
    q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, "w")
    heads = await q.peek_heads(block_ms=10)
    assert {t: h.deadline_ms for t, h in heads.items()} == {"interactive": 1}
    assert await q.peek_heads(block_ms=10) == heads
    info = await r.xinfo_groups(keys.stream("prefill", "interactive"))
    assert info[0]["pending"] == 0


async def test_backlog_counts_queued_prompt_tokens_per_tier(r, key_prefix):
    from skyline.core.streams import queued_tokens

    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "prefill")
    for rid, tier in (("a", "interactive"), ("b", "batch"), ("c", "batch")):
        await enqueue(r, keys, "prefill", request(rid, tier, 1), 1000)  # 3 prompt tokens each
    assert await queued_tokens(r, keys, "prefill") == {"interactive": 3, "batch": 6}
    q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, "w")
    claimed = await q.claim(block_ms=10)
    # Claimed work is still ahead of new requests until it is done.
    assert await queued_tokens(r, keys, "prefill") == {"interactive": 3, "batch": 6}
    await q.ack(claimed)
    assert await queued_tokens(r, keys, "prefill") == {"interactive": 0, "batch": 6}
    # Decode work carrying a KV handle needs no prefill: not part of the backlog.
    await enqueue(r, keys, "decode", m.DecodeWork(request("d", "batch", 1), kv_handle={"h": 1}), 1000)
    assert await queued_tokens(r, keys, "decode") == {}
    await enqueue(r, keys, "decode", m.DecodeWork(request("e", "batch", 1), kv_handle=None), 1000)
    assert await queued_tokens(r, keys, "decode") == {"batch": 3}



async def test_a_reservation_becomes_what_the_entry_adds_to_the_backlog(r, key_prefix):
    """Admission control reserves the whole prompt under the route its length gives; the enqueue leaves
    the backlog holding what the entry really adds: moved to a demoted tier or another stage, cut to
    the tokens its prefix cache does not hold. A refused request's release leaves nothing behind."""
    from skyline.core.streams import Reservation, backlog_seen, queue_reservation, queued_tokens, release_backlog

    keys = Keys(key_prefix)
    for stage in ("prefill", "decode"):
        await ensure_groups(r, keys, TIERS, stage)
    await enqueue(r, keys, "prefill", request("old", "interactive", 1), 1000)  # 3 tokens already queued

    async def reserve(stage, tier, tokens):
        res = Reservation(stage, tier, tokens)
        pipe = r.pipeline(transaction=False)
        queue_reservation(pipe, keys, res)
        _, raw = await pipe.execute()
        return res, backlog_seen(raw, stage, res)

    res, seen = await reserve("prefill", "interactive", 3)
    assert seen == {"interactive": 3}  # the others' tokens, not its own
    assert await queued_tokens(r, keys, "prefill") == {"interactive": 6}
    demoted = request("a", "batch", 1)
    await enqueue(r, keys, "prefill", demoted, 1000, reserved=res)
    assert await queued_tokens(r, keys, "prefill") == {"interactive": 3, "batch": 3}

    res, _ = await reserve("prefill", "interactive", 3)  # re-routed: its decode worker computes 1 token
    await enqueue(r, keys, "decode", m.DecodeWork(request("b", "interactive", 1), kv_handle=None), 1000,
                  reserved=res, prefill_tokens=1)
    assert await queued_tokens(r, keys, "prefill") == {"interactive": 3, "batch": 3}
    assert await queued_tokens(r, keys, "decode") == {"interactive": 1}

    res, _ = await reserve("decode", "standard", 50)
    await release_backlog(r, keys, res.stage, res.tier, res.tokens)  # refused
    assert await queued_tokens(r, keys, "decode") == {"interactive": 1, "standard": 0}

# -- prefix affinity: the affinity lanes and the cache view (scheduler/prefix.py) ----------------

async def _alive(r, keys, *workers):
    for w in workers:
        await heartbeat(r, keys, WorkerInfo(w, "decode", "sim", "m", "h", 1, 0, 0, 0.0, 0.0, 0.0), ttl_s=10)


async def test_placed_work_is_its_holders_until_the_bound_then_anyones(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "decode")
    await _alive(r, keys, "w1", "w2")
    until = now_ms() + 600
    await enqueue(r, keys, "decode", m.DecodeWork(request("placed", deadline_ms=now_ms() + 5_000), None), 1000,
                  placement=Placement("w1", until, 3))
    await enqueue(r, keys, "decode", m.DecodeWork(request("shared", deadline_ms=now_ms() + 9_000), None), 1000)
    w1, w2 = (TierQueues(r, keys, "decode", DEFAULT_TIERS, w) for w in ("w1", "w2"))
    # w2 takes the shared entry, not the one placed for w1 although it is due first ...
    got = await w2.claim(block_ms=100)
    assert got.message.request.request_id == "shared"
    t0 = now_ms()
    got = None
    while got is None and now_ms() - t0 < 3_000:  # each claim waits (for the bound at most), never spins
        got = await w2.claim(block_ms=2_000)
    assert got is not None and got.message.request.request_id == "placed"
    assert now_ms() >= until  # ... until the bound, then takes it
    # w1 would have taken it at once: the holder sees its own lane's head.
    assert await w1.claim(block_ms=10) is None


async def test_the_holder_claims_at_once_and_a_dead_holders_work_is_taken_at_once(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "decode")
    await _alive(r, keys, "w1", "w2")
    far = now_ms() + 60_000
    await enqueue(r, keys, "decode", m.DecodeWork(request("a", deadline_ms=far), None), 1000, placement=Placement("w1", far))
    w1 = TierQueues(r, keys, "decode", DEFAULT_TIERS, "w1")
    got = await w1.claim(block_ms=100)
    assert got.message.request.request_id == "a" and got.stream == keys.affinity_lane("decode", "standard", "w1")
    await w1.ack(got)
    await enqueue(r, keys, "decode", m.DecodeWork(request("b", deadline_ms=far), None), 1000, placement=Placement("gone", far))
    w2 = TierQueues(r, keys, "decode", DEFAULT_TIERS, "w2")  # "gone" never heartbeated
    got = await w2.claim(block_ms=100)
    assert got.message.request.request_id == "b"
    await w2.ack(got)
    # The departed worker's lanes, empty now, are removed; the live one's stay.
    await forget_departed(w2, after_s=5)
    assert await r.smembers(keys.affinity_lanes("decode")) == {b"w1"}
    assert not await r.exists(keys.affinity_lane("decode", "standard", "gone"))


async def test_an_entry_waiting_for_its_bound_does_not_block_the_others_of_its_tier(r, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(r, keys, TIERS, "decode")
    await _alive(r, keys, "w1", "w2")
    far = now_ms() + 60_000
    await enqueue(r, keys, "decode", m.DecodeWork(request("for-w1", deadline_ms=far - 1), None), 1000,
                  placement=Placement("w1", far))
    w2 = TierQueues(r, keys, "decode", DEFAULT_TIERS, "w2")
    pending = asyncio.create_task(w2.claim(block_ms=1_000))
    await asyncio.sleep(0.2)
    await enqueue(r, keys, "decode", m.DecodeWork(request("later", deadline_ms=far), None), 1000)
    got = await pending  # woken by the new shared entry, not by the bound a minute away
    assert got is not None and got.message.request.request_id == "later"


async def test_the_cache_view_is_bounded_and_expires_with_its_worker(r, key_prefix):
    keys = Keys(key_prefix)
    flood = [f"{i:016x}" for i in range(5_000)]  # a flood of distinct prefixes
    for i in range(0, len(flood), 500):
        await cache_view.apply(r, keys, "w1", flood[i:i + 500], [], False, max_blocks=1_000, ttl_s=10)
    assert await r.zcard(keys.kv_cache("w1")) == 1_000 and 0 < await r.ttl(keys.kv_cache("w1")) <= 10
    assert await r.zscore(keys.kv_cache("w1"), flood[-1]) is not None  # the newest are kept
    assert (await cache_view.matched(r, keys, ["w1", "w2"], flood[-3:] + ["nope"])) == {"w1": 3, "w2": 0}
    await cache_view.apply(r, keys, "w1", [], flood[-2:], False, 1_000, 10)
    assert (await cache_view.matched(r, keys, ["w1"], flood[-3:])) == {"w1": 1}
    await cache_view.apply(r, keys, "w1", ["ab" * 8], [], True, 1_000, 10)  # cleared, then one stored
    assert await r.zcard(keys.kv_cache("w1")) == 1
