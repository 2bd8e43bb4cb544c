"""Prefix affinity: the block chain and the placement rule (pure), and a sim fleet whose
conversations are served where their history is cached, and elsewhere once that worker is
gone, within the bound."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import openai
import redis

from skyline.core.keys import Keys
from skyline.scheduler.prefix import (
    AffinityPolicy,
    Holder,
    block_chain,
    chain_from,
    matched_blocks,
    may_claim,
    place,
    wait_bound_ms,
)
from tests.fleet import Fleet


def test_the_chain_keys_each_block_by_everything_before_it():
    tokens = list(range(100))
    chain = block_chain(tokens, 16, 100)
    assert len(chain) == 6 and len(set(chain)) == 6  # six full blocks; the 4 tokens after them are not a block
    assert block_chain(tokens[:96], 16, 100) == chain and block_chain(tokens, 16, 2) == chain[:2]
    assert chain_from(chain[1], tokens[32:64], 16) == chain[2:4]  # a worker extends what its engine stored
    changed = tokens[:]
    changed[20] = 999
    other = block_chain(changed, 16, 100)
    assert other[0] == chain[0] and not set(other[1:]) & set(chain)  # one token changes its block and all after
    assert block_chain(tokens, 16, 100, salt="tenant-a")[0] != chain[0]
    assert block_chain(tokens, 0, 100) == [] and block_chain(tokens[:15], 16, 100) == []


def test_a_prompt_at_the_context_limit_costs_a_bounded_chain():
    assert len(block_chain(list(range(1_000_000)), 16, 512)) == 512


def test_only_a_leading_run_counts():
    chain = ["a", "b", "c", "d"]
    assert matched_blocks(chain, {"a", "b", "d"}) == 2 and matched_blocks(chain, {"b", "c"}) == 0


def test_placement_waits_for_the_longest_holder_that_is_not_overloaded():
    policy = AffinityPolicy(min_blocks=2)
    w1, w2, w3 = Holder("w1", 5, False), Holder("w2", 9, True), Holder("w3", 7, False)
    assert place(policy, [w1, w2, w3]) == w3  # w2 holds more but is full
    assert place(policy, [Holder("w1", 1, False), Holder("w2", 0, False)]) is None  # not worth waiting for
    assert place(policy, [w3]) == w3  # alone of its stage (the gateway places only with two or more)
    assert place(AffinityPolicy(enabled=False), [w1, w3]) is None


def test_what_every_worker_holds_is_left_to_the_shared_queue():
    # A system prompt all engines have cached: waiting for one of them buys nothing, and the shared
    # queue balances the load.
    assert place(AffinityPolicy(), [Holder("w1", 17, False), Holder("w2", 17, False)]) is None
    assert place(AffinityPolicy(), [Holder("w1", 20, False), Holder("w2", 17, False)]).worker == "w1"
    assert place(AffinityPolicy(), [Holder("w1", 17, True), Holder("w2", 3, False)]).worker == "w2"  # w1 is full
    assert place(AffinityPolicy(min_blocks=4), [Holder("w1", 17, True), Holder("w2", 3, False)]) is None


def test_the_wait_is_a_share_of_the_slack_and_never_past_it():
    policy = AffinityPolicy(slack_share=0.5, max_wait_ms=2_000)
    assert wait_bound_ms(policy, 1_000, 2_000) == 1_500  # half of 1 s of slack
    assert wait_bound_ms(policy, 1_000, 60_000) == 3_000  # capped
    assert wait_bound_ms(policy, 5_000, 4_000) == 5_000  # late already: nobody waits


def test_others_may_claim_once_the_bound_passes_or_the_holder_is_gone():
    assert may_claim("w1", "w1", 0, 10_000, True)  # the holder, at once
    assert not may_claim("w2", "w1", 9_999, 10_000, True)
    assert may_claim("w2", "w1", 10_000, 10_000, True)  # no starvation: past the bound, anyone
    assert may_claim("w2", "w1", 0, 10_000, False)  # a dead holder waits for nobody


def _turns(client, history: str, question: str, max_tokens: int = 24):
    prompt = history + question
    r = client.completions.create(model="skyline-sim", prompt=prompt, max_tokens=max_tokens)
    return prompt + r.choices[0].text, r.model_extra["skyline"]


def test_each_turn_of_a_conversation_is_served_where_its_history_is_cached(redis_url, key_prefix, tmp_path):
    (tmp_path / "cfg.toml").write_text('[gateway]\nmode = "colocated"\n')
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    r = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    with fleet.running({"decode-1": ("decode",), "decode-2": ("decode",)}, timeout_s=60):
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
        system = "You are a careful assistant. Answer briefly and cite the document. " * 4
        convs = {c: system + f"Conversation {c}: " for c in range(6)}
        served: dict[int, list[str]] = {c: [] for c in convs}
        cached: list[tuple[int, int]] = []
        with concurrent.futures.ThreadPoolExecutor(len(convs)) as pool:  # first turns at once: nothing cached yet
            firsts = {c: pool.submit(_turns, client, convs[c], "\nUser: hello?\nAssistant:") for c in convs}
            for c, f in firsts.items():
                convs[c], ext = f.result()
                served[c].append(ext["decode_worker"])
        for turn in range(1, 3):
            time.sleep(0.3)  # the users read the answers (and the workers' views catch up: every 50 ms)
            for c in convs:
                before = len(convs[c])
                convs[c], ext = _turns(client, convs[c], f"\nUser: question {turn} of {c}?\nAssistant:")
                served[c].append(ext["decode_worker"])
                cached.append((ext["kv_transfer"]["num_cached_tokens"], before))
                assert ext["placement"]["worker"] == served[c][0], ext
        for c, workers in served.items():
            assert len(set(workers)) == 1, served  # every turn where the first one was computed
        assert len({w[0] for w in served.values()}) == 2, served  # and both workers were used
        # A later turn finds at least its history's full blocks (bytes = tokens in the sim).
        assert all(n >= (before // 16) * 16 - 16 for n, before in cached), cached
        for w in ("decode-1", "decode-2"):
            assert r.zcard(keys.kv_cache(w)) > 0  # the view, in Redis
            assert 0 < r.ttl(keys.kv_cache(w)) <= 10  # expiring with the worker
        assert r.smembers(keys.affinity_lanes("decode")) == {b"decode-1", b"decode-2"}
        timeline = client.get(f"/requests/{ext['request_id']}/timeline", cast_to=object)
        placed = [e for e in timeline["events"] if e["event"] == "placed"]
        assert placed and placed[0]["fields"]["worker"] == served[5][0]
        metrics = fleet.worker_metrics(served[5][0])
        assert 'skyline_worker_prompt_tokens_total{source="cached"}' in metrics

        # The holder dies: the next turn is served by the other worker, within the bound.
        holder = served[0][0]
        other = ({"decode-1", "decode-2"} - {holder}).pop()
        fleet.stop(holder, sig=signal.SIGKILL)
        t0 = time.monotonic()
        _, ext = _turns(client, convs[0], "\nUser: are you still there?\nAssistant:")
        assert ext["decode_worker"] == other
        bound_s = AffinityPolicy().max_wait_ms / 1000
        assert time.monotonic() - t0 < bound_s + 3, time.monotonic() - t0  # the bound, and a claim loop's turn


# -- the affinity lanes and the cache view against a real redis-server --------------------------

import asyncio  # noqa: E402

import pytest  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from skyline.core import cache_view  # noqa: E402
from skyline.core import messages as m  # noqa: E402
from skyline.core.fleet import WorkerInfo, heartbeat  # noqa: E402
from skyline.core.streams import Placement, TierQueues, enqueue, ensure_groups, now_ms  # noqa: E402
from skyline.scheduler.tiers import DEFAULT_TIERS  # noqa: E402
from skyline.workers.reaper import forget_departed  # noqa: E402

TIERS = tuple(t.name for t in DEFAULT_TIERS)


def _request(rid: str, deadline_ms: int, tier: str = "standard") -> m.GenerateRequest:
    return m.GenerateRequest(rid, "sim", [1, 2, 3], m.SamplingSpec(), tier, 0, deadline_ms, 1000, 100)


@pytest.fixture
async def ar(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


async def _alive(r, keys, *workers):
    for w in workers:
        await heartbeat(r, keys, WorkerInfo(w, "decode", "sim", "m", "h", 1, 0, 0, 0.0, 0.0, 0.0), ttl_s=10)


async def test_placed_work_is_its_holders_until_the_bound_then_anyones(ar, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(ar, keys, TIERS, "decode")
    await _alive(ar, keys, "w1", "w2")
    until = now_ms() + 600
    await enqueue(ar, keys, "decode", m.DecodeWork(_request("placed", now_ms() + 5_000), None), 1000,
                  placement=Placement("w1", until, 3))
    await enqueue(ar, keys, "decode", m.DecodeWork(_request("shared", now_ms() + 9_000), None), 1000)
    w1, w2 = (TierQueues(ar, keys, "decode", DEFAULT_TIERS, w) for w in ("w1", "w2"))
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


async def test_the_holder_claims_at_once_and_a_dead_holders_work_is_taken_at_once(ar, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(ar, keys, TIERS, "decode")
    await _alive(ar, keys, "w1", "w2")
    far = now_ms() + 60_000
    await enqueue(ar, keys, "decode", m.DecodeWork(_request("a", far), None), 1000, placement=Placement("w1", far))
    w1 = TierQueues(ar, keys, "decode", DEFAULT_TIERS, "w1")
    got = await w1.claim(block_ms=100)
    assert got.message.request.request_id == "a" and got.stream == keys.affinity_lane("decode", "standard", "w1")
    await w1.ack(got)
    await enqueue(ar, keys, "decode", m.DecodeWork(_request("b", far), None), 1000, placement=Placement("gone", far))
    w2 = TierQueues(ar, keys, "decode", DEFAULT_TIERS, "w2")  # "gone" never heartbeated
    got = await w2.claim(block_ms=100)
    assert got.message.request.request_id == "b"
    await w2.ack(got)
    # The departed worker's lanes, empty now, are removed; the live one's stay.
    await forget_departed(w2, after_s=5)
    assert await ar.smembers(keys.affinity_lanes("decode")) == {b"w1"}
    assert not await ar.exists(keys.affinity_lane("decode", "standard", "gone"))


async def test_an_entry_waiting_for_its_bound_does_not_block_the_others_of_its_tier(ar, key_prefix):
    keys = Keys(key_prefix)
    await ensure_groups(ar, keys, TIERS, "decode")
    await _alive(ar, keys, "w1", "w2")
    far = now_ms() + 60_000
    await enqueue(ar, keys, "decode", m.DecodeWork(_request("for-w1", far - 1), None), 1000,
                  placement=Placement("w1", far))
    w2 = TierQueues(ar, keys, "decode", DEFAULT_TIERS, "w2")
    pending = asyncio.create_task(w2.claim(block_ms=1_000))
    await asyncio.sleep(0.2)
    await enqueue(ar, keys, "decode", m.DecodeWork(_request("later", far), None), 1000)
    got = await pending  # woken by the new shared entry, not by the bound a minute away
    assert got is not None and got.message.request.request_id == "later"


async def test_the_cache_view_is_bounded_and_expires_with_its_worker(ar, key_prefix):
    keys = Keys(key_prefix)
    flood = [f"{i:016x}" for i in range(5_000)]  # a flood of distinct prefixes
    for i in range(0, len(flood), 500):
        await cache_view.apply(ar, keys, "w1", flood[i:i + 500], [], False, max_blocks=1_000, ttl_s=10)
    assert await ar.zcard(keys.kv_cache("w1")) == 1_000 and 0 < await ar.ttl(keys.kv_cache("w1")) <= 10
    assert await ar.zscore(keys.kv_cache("w1"), flood[-1]) is not None  # the newest are kept
    assert (await cache_view.matched(ar, keys, ["w1", "w2"], flood[-3:] + ["nope"])) == {"w1": 3, "w2": 0}
    await cache_view.apply(ar, keys, "w1", [], flood[-2:], False, 1_000, 10)
    assert (await cache_view.matched(ar, keys, ["w1"], flood[-3:])) == {"w1": 1}
    await cache_view.apply(ar, keys, "w1", ["ab" * 8], [], True, 1_000, 10)  # cleared, then one stored
    assert await ar.zcard(keys.kv_cache("w1")) == 1
