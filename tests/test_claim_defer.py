"""Who claims a new prompt first (scheduler/claiming.py "Who claims first"): a worker whose engine computes
prompts waits only while a peer, as its heartbeat said, would be free sooner, for the difference of their
times to free (capped), counting the tokens its engine has left; the live claim loop wakes when one of
its prompts frees the step budget."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from skyline.core import messages as m
from skyline.core.config import SkylineConfig
from skyline.core.fleet import WorkerInfo
from skyline.core.keys import Keys
from skyline.core.streams import Claimed, Head, TierQueues, enqueue, ensure_groups
from skyline.scheduler.claiming import (CLAIM_DEFER_MAX_S, IDLE_PEER_ANSWER_S, LONG_PROMPT_MEMORY_S, NO_PEERS,
                                        claim_defer_s, computes_long, freest_peers, leaves_until_due,
                                        long_prompt_defer_s, tokens_left)
from skyline.scheduler.tiers import DEFAULT_TIERS
from skyline.workers import runtime as live_runtime
from skyline.workers.held import HeldRequest, HeldTable, Phase
from skyline.workers.runtime import WorkerRuntime

# -- the rule: claim_defer_s -------------------------------------------------------------------------------


def test_no_freer_peer_means_claim_now():
    assert claim_defer_s(128, 1, 1000, [1], 1000.0, None) == 0.0  # no peer of the stage with room
    assert claim_defer_s(128, 1, 1000, [1], 1000.0, 2.0) == 0.0  # the freest peer frees later (2 s against 1 s)
    assert claim_defer_s(128, 1, 1000, [1], 1000.0, 1.0) == 0.0  # as late: nobody takes it sooner


def test_a_freer_peer_gets_the_difference_of_the_times_to_free_capped():
    assert claim_defer_s(128, 1, 200, [1], 1000.0, 0.05) == pytest.approx(0.15)
    assert claim_defer_s(128, 1, 100, [1], 1000.0, 0.0) == pytest.approx(0.1)  # an idle peer: the whole time
    assert claim_defer_s(128, 1, 2000, [1], 1000.0, 0.0) == CLAIM_DEFER_MAX_S
    assert claim_defer_s(128, 1, 2000, [1], 1000.0, 1.9) == pytest.approx(0.1)  # 2 s against 1.9 s


def test_a_stricter_tier_than_anything_computing_is_left_briefly_to_a_peer_computing_no_prompt():
    # An idle peer gives it steps nobody else waits for: it gets the time an idle peer takes to answer.
    assert claim_defer_s(128, 0, 1024, [1, 2], 200.0, 0.0) == pytest.approx(IDLE_PEER_ANSWER_S)
    assert claim_defer_s(128, 0, 1024, [1, 2], 200.0, 0.0, max_s=0.05) == pytest.approx(0.05)
    assert claim_defer_s(128, 1, 1024, [1, 2], 200.0, 0.0) == CLAIM_DEFER_MAX_S  # as strict as one computing


def test_a_stricter_tier_is_claimed_at_once_when_every_peer_computes_prompts():
    # It would wait only for the step in progress here (its steps come first), and as long or longer there.
    assert claim_defer_s(128, 0, 1024, [1, 2], 200.0, 0.01) == 0.0
    assert claim_defer_s(128, 0, 1024, [1, 2], 200.0, None) == 0.0  # no peer at all


def test_nothing_to_weigh_means_no_wait():
    assert claim_defer_s(128, 1, 0, [], 200.0, 0.0) == 0.0  # nothing left to compute
    assert claim_defer_s(0, 1, 1024, [1], 200.0, 0.0) == 0.0  # a KV hand-off: no prompt to compute
    assert claim_defer_s(128, 1, 1024, [1], 0.0, 0.0) == 0.0  # no rate
    assert claim_defer_s(128, 1, 1024, [1], 200.0, 0.0, max_s=0.0) == 0.0  # off


# -- tokens left -------------------------------------------------------------------------------------------


def test_tokens_left_counts_what_the_engine_reports():
    assert tokens_left([(1000, 0.0, 400), (300, 5.0, 0)], 1000.0, now=10.0) == 900


def test_tokens_left_estimates_prompts_one_after_another_from_their_claims():
    assert tokens_left([(300, 9.9, None)], 1000.0, now=10.0) == 200  # 0.1 s at 1,000 tokens/s
    assert tokens_left([(300, 9.9, None), (500, 9.9, None)], 1000.0, now=10.0) == 700  # claimed together
    # The first was done 0.3 s ago: the second, claimed 50 ms ago, started at its claim.
    assert tokens_left([(200, 9.5, None), (500, 9.95, None)], 1000.0, now=10.0) == 450
    # Claimed while the first computed: it starts after it.
    assert tokens_left([(500, 9.8, None), (300, 9.9, None)], 1000.0, now=10.0) == 600
    assert tokens_left([(100, 9.0, None)], 1000.0, now=10.0) == 0  # past its estimate: about to finish
    assert tokens_left([(100, 9.0, None)], 0.0, now=10.0) == 100  # no rate: the whole prompt


# -- the peers, as their heartbeats said ---------------------------------------------------------------------


def _peer(wid: str, role: str, tokens: int, rate: float = 1000.0, running: int = 1, kv: float = 0.0,
          left: int | None = None, seen: float = 0.0, computes_long: int = 0):
    return SimpleNamespace(worker_id=wid, role=role, running=running, max_running=8, kv_usage=kv,
                           kv_watermark=0.9 if role != "prefill" else 0.0, running_tokens=tokens, tokens_per_s=rate,
                           left_tokens=tokens if left is None else left, last_seen=seen, computes_long=computes_long)


def test_the_freest_peer_of_the_stage_with_room_and_never_oneself():
    peers = [_peer("e0", "elastic", 500), _peer("e1", "elastic", 2000, rate=4000.0), _peer("p0", "prefill", 100),
             _peer("d0", "decode", 0), _peer("full", "elastic", 0, running=8), _peer("kv", "elastic", 0, kv=0.95),
             _peer("new", "decode", 300, rate=0.0)]
    freest = freest_peers(peers, prompt_budget=2048, prior_tokens_per_s=1000.0)
    assert freest.free_s("x", "prefill", 0.0) == pytest.approx(0.1)  # p0 (the full and the KV-bound claim nothing)
    assert freest.free_s("p0", "prefill", 0.0) == pytest.approx(0.5)  # e1: 2,000 tokens at 4,000/s
    assert freest.free_s("x", "decode", 0.0) == 0.0
    assert freest.free_s("d0", "decode", 0.0) == pytest.approx(0.3)  # prior rate
    assert freest_peers([_peer("e0", "elastic", 3000)], 2048, 1000.0).free_s("x", "decode", 0.0) is None  # over budget
    assert NO_PEERS.free_s("x", "prefill", 0.0) is None


def test_a_peers_time_to_free_is_what_it_had_left_counted_from_its_beat():
    """A peer holding a 2,000-token prompt of which 300 tokens were left when it beat at t=10.0 is free at
    10.3: read at 10.1 it frees in 0.2 s, read at 10.5 it should be free already. Its whole prompt, or a
    time counted from the read, would make a peer that has since freed look busy to a worker that then
    takes queued prompts while it idles."""
    freest = freest_peers([_peer("e0", "elastic", 2000, left=300, seen=10.0),
                           _peer("e1", "elastic", 500, left=400, seen=10.05)], 4096, 1000.0)
    assert freest.free_s("x", "decode", 10.1) == pytest.approx(0.2)  # e0: free at 10.3, e1 at 10.45
    assert freest.free_s("e0", "decode", 10.1) == pytest.approx(0.35)
    assert freest.free_s("x", "decode", 10.5) == 0.0


def test_the_peer_computing_no_prompt_with_the_fewest_streams_and_never_oneself():
    peers = [_peer("e0", "elastic", 0, running=3), _peer("e1", "elastic", 0, running=1),
             _peer("busy", "elastic", 500, running=0), _peer("d0", "decode", 0, running=0),
             _peer("full", "elastic", 0, running=8)]
    freest = freest_peers(peers, prompt_budget=2048, prior_tokens_per_s=1000.0)
    assert freest.fewest_streams("x", "prefill") == 1  # e1 (busy computes a prompt; d0 claims no prompts)
    assert freest.fewest_streams("e1", "prefill") == 3
    assert freest.fewest_streams("x", "decode") == 0  # d0
    assert NO_PEERS.fewest_streams("x", "prefill") is None


def test_a_long_prompt_is_left_to_a_peer_decoding_fewer_streams_for_as_long_as_an_idle_peer_takes():
    assert long_prompt_defer_s(3, 1) == pytest.approx(IDLE_PEER_ANSWER_S)
    assert long_prompt_defer_s(3, 0, max_s=0.05) == pytest.approx(0.05)
    assert long_prompt_defer_s(1, 1) == 0.0  # as many: no one is better placed, claim it now
    assert long_prompt_defer_s(0, 0) == 0.0
    assert long_prompt_defer_s(3, None) == 0.0  # every peer computes (the rule above weighs that) or none
    assert long_prompt_defer_s(3, 1, max_s=0.0) == 0.0  # the defer is off


def test_the_freest_peers_with_room_where_long_prompts_gather_and_where_they_do_not_never_oneself():
    peers = [_peer("rag", "elastic", 1400, running=2, computes_long=1, seen=10.0),
             _peer("rag2", "elastic", 2000, running=1, computes_long=1, seen=10.0),
             _peer("chat", "elastic", 150, running=4, seen=10.0),
             _peer("full", "elastic", 0, running=8, computes_long=1)]
    freest = freest_peers(peers, prompt_budget=2048, prior_tokens_per_s=1000.0)
    assert freest.free_at_with_long("chat", "prefill") == pytest.approx(11.4)  # rag: 1400 tokens at 1000/s
    assert freest.free_at_with_long("rag", "prefill") == pytest.approx(12.0)  # rag2 (full has no room)
    assert freest.least_held_without_long("rag", "decode") == (4, pytest.approx(10.15))  # chat
    assert freest.least_held_without_long("chat", "decode") is None
    assert NO_PEERS.least_held_without_long("x", "decode") is None
    assert NO_PEERS.free_at_with_long("x", "prefill") is None


def test_long_prompts_gather_on_an_engine_while_it_computes_one_and_for_a_while_after():
    m = LONG_PROMPT_MEMORY_S
    assert not computes_long(None, 100.0, m)
    assert computes_long(100.0, 100.0, m)
    assert computes_long(100.0, 100.0 + m - 0.1, m)
    assert not computes_long(100.0, 100.0 + m, m)
    assert not computes_long(100.0, 100.0, 0.0)  # the rule is off (the default)


def test_where_long_prompts_gather_short_prompts_are_left_to_a_peer_where_they_do_not_free_in_time():
    due = 20.0  # the head's latest start

    def short(long_here=True, held_here=5, without_long=(2, 19.0), tokens=150):
        return leaves_until_due("decode", tokens, due, long_here=long_here, held_here=held_here,
                                free_at_with_long=1.0, without_long=without_long)

    assert short()
    assert short(without_long=(2, 20.0))
    # That peer would not be free before the head must start: leaving it would make it wait for nothing.
    assert not short(without_long=(2, 20.5))
    # It holds as many requests: in a fleet of mostly long prompts, its few engines would gather every stream.
    assert not short(held_here=2)
    assert not short(without_long=None)
    assert not short(long_here=False)
    assert not short(tokens=0)  # a KV hand-off


def test_a_long_prompt_is_left_to_a_peer_where_long_prompts_gather_free_in_time():
    due = 20.0

    def long(long_here=False, free_at_with_long=15.0, tokens=1400):
        return leaves_until_due("prefill", tokens, due, long_here=long_here, held_here=0,
                                free_at_with_long=free_at_with_long, without_long=(0, 1.0))

    assert long()
    assert not long(free_at_with_long=25.0)  # busy past the head's latest start
    # Where they gather here too (every engine computes long prompts), nothing is left: the claim defer decides.
    assert not long(long_here=True)
    assert not long(free_at_with_long=None)
    assert not long(tokens=0)


# -- the live worker ---------------------------------------------------------------------------------------


class _Engine:
    kind = "sim"

    def __init__(self, computed: dict[str, int] | None = None):
        self.computed = computed or {}

    def stats(self):
        return SimpleNamespace(kv_usage=0.0, waiting=0)

    def computed_tokens(self, request_id: str) -> int | None:
        return self.computed.get(request_id)


def _runtime(monkeypatch, role: str = "prefill", engine: _Engine | None = None) -> WorkerRuntime:
    cfg = SkylineConfig()
    cfg = replace(cfg, worker=replace(cfg.worker, role=role, worker_id="me"),
                  observability=replace(cfg.observability, timeline=False, log_events=False))
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(live_runtime, "time", SimpleNamespace(monotonic=lambda: clock.now, time=lambda: clock.now))
    rt = WorkerRuntime(cfg, engine or _Engine(), "m")
    rt.clock = clock  # type: ignore[attr-defined]
    return rt


def _hold(rt: WorkerRuntime, rid: str, tokens: int, tier: str = "standard") -> HeldRequest:
    req = m.GenerateRequest(rid, "m", [1] * tokens, m.SamplingSpec(max_tokens=4), tier, 0, 10**13, 1000, 100)
    held = HeldRequest.of(Claimed("stream", "0-1", tier, req), rt.rules.first_phase(req))
    rt.hold(held, None)  # type: ignore[arg-type]
    return held


def _info(wid: str, role: str, tokens: int, rate: float = 1000.0, seen: float = 100.0) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, engine="sim", model="m", host="h", pid=1, running=1, waiting=0,
                      kv_usage=0.0, started=0.0, last_seen=seen, running_tokens=tokens, tokens_per_s=rate, left_tokens=tokens,
                      max_running=32)


HEAD = Head("standard", 10**13, 300, prefill_tokens=300, stage="prefill")


def test_the_live_worker_waits_only_for_a_freer_peer_and_counts_its_tokens_left(monkeypatch):
    rt = _runtime(monkeypatch)
    assert rt._claim_defer(HEAD) == 0.0  # computing nothing
    _hold(rt, "a", 1000)  # claimed at 100.0 s: 1 s of prompt at the prior 1,000 tokens/s
    rt.see_peers([_info("me", "prefill", 1000)])
    assert rt._claim_defer(HEAD) == 0.0  # no peer but itself: claim now
    rt.see_peers([_info("me", "prefill", 1000), _info("p1", "prefill", 1500)])
    assert rt._claim_defer(HEAD) == 0.0  # the peer frees later
    rt.see_peers([_info("me", "prefill", 1000), _info("p1", "prefill", 900)])
    assert rt._claim_defer(HEAD) == pytest.approx(0.1)  # 1 s against 0.9 s
    rt.clock.now = 100.05  # type: ignore[attr-defined]
    assert rt._claim_defer(HEAD) == pytest.approx(0.1)  # both 50 ms on: 950 tokens left here, the peer's 0.85 s
    rt.see_peers([_info("me", "prefill", 1000), _info("p1", "prefill", 900, seen=100.05)])
    assert rt._claim_defer(HEAD) == pytest.approx(0.05)  # 950 left here against a fresh beat's 900
    rt.see_peers([_info("me", "prefill", 1000), _info("e1", "elastic", 0), _info("d1", "decode", 0)])
    assert rt._claim_defer(HEAD) == CLAIM_DEFER_MAX_S  # an idle peer of the stage (the decode worker is not one)
    assert rt._claim_defer(replace(HEAD, tier="interactive")) == IDLE_PEER_ANSWER_S  # stricter: left to the idle peer
    rt.see_peers([_info("me", "prefill", 1000), _info("p1", "prefill", 500)])
    assert rt._claim_defer(replace(HEAD, tier="interactive")) == 0.0  # no idle peer: claimed now, it may preempt
    assert rt._claim_defer(replace(HEAD, prefill_tokens=0)) == 0.0  # a KV hand-off


def test_the_live_worker_counts_the_progress_its_engine_reports(monkeypatch):
    rt = _runtime(monkeypatch, role="elastic", engine=_Engine({"a": 880}))
    _hold(rt, "a", 1000)
    rt.see_peers([_info("e1", "elastic", 0)])
    assert rt._claim_defer(HEAD) == pytest.approx(0.12)  # 120 tokens left, at once
    assert rt._claim_defer(replace(HEAD, stage="decode")) == pytest.approx(0.12)  # an elastic peer takes either


def test_an_elastic_worker_decoding_streams_leaves_a_long_prompt_to_a_peer_decoding_fewer(monkeypatch):
    rt = _runtime(monkeypatch, role="elastic")
    for rid in ("s1", "s2"):  # two streams decoding here, no prompt computing
        stream = _hold(rt, rid, 100)
        stream.serve_as = "decode"
        stream.first_token()
    rt.see_peers([_info("me", "elastic", 0), replace(_info("e1", "elastic", 0), running=1)])
    assert rt._claim_defer(HEAD) == pytest.approx(IDLE_PEER_ANSWER_S)  # a long prompt (the prefill streams')
    assert rt._claim_defer(replace(HEAD, stage="decode")) == 0.0  # a short one: where it finishes first
    rt.see_peers([_info("me", "elastic", 0), replace(_info("e1", "elastic", 0), running=2)])
    assert rt._claim_defer(HEAD) == 0.0  # the peer decodes as many
    rt.see_peers([_info("me", "elastic", 0), replace(_info("e1", "elastic", 300), running=0)])
    assert rt._claim_defer(HEAD) == 0.0  # the peer computes a prompt of its own
    fixed = _runtime(monkeypatch, role="decode")
    _hold(fixed, "s1", 100).first_token()
    fixed.see_peers([_info("me", "decode", 0), replace(_info("d1", "decode", 0), running=0)])
    assert fixed._claim_defer(replace(HEAD, stage="decode")) == 0.0  # a decode worker's prompts are all short


def test_the_held_table_signals_when_a_prompt_frees_the_step_budget():
    table = HeldTable()

    def held(rid: str, phase: Phase) -> HeldRequest:
        req = m.GenerateRequest(rid, "m", [1] * 10, m.SamplingSpec(), "standard", 0, 0, 1000, 100)
        h = HeldRequest(Claimed("s", "0-1", "standard", req), req, phase)
        table.add(h)
        return h

    streaming = held("kv", Phase.DECODING)
    streaming.first_token()
    assert not table.freed.is_set()  # its prompt was never computed here
    table.release(streaming)
    assert not table.freed.is_set()
    decode = held("d", Phase.COMPUTING)
    decode.first_token()
    assert table.freed.is_set()
    table.freed.clear()
    prefill = held("p", Phase.COMPUTING)
    prefill.prompt_computed()
    assert table.freed.is_set()
    table.freed.clear()
    preempted = held("x", Phase.COMPUTING)
    table.release(preempted)  # aborted while computing: its task unwound
    assert table.freed.is_set()


@pytest.fixture
async def r(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_deferred_claim_wakes_when_a_prompt_frees_the_engine(r, key_prefix):
    """Against a real Redis: a claim deferred 5 s is made as soon as the worker's `wake` event is set."""
    keys = Keys(key_prefix)
    tiers = tuple(t.name for t in DEFAULT_TIERS)
    await ensure_groups(r, keys, tiers, "prefill")
    req = m.GenerateRequest("new", "m", [1] * 300, m.SamplingSpec(), "standard", 0, 1, 1000, 100)
    await enqueue(r, keys, "prefill", req, 1000)
    q = TierQueues(r, keys, "prefill", DEFAULT_TIERS, "w")
    wake = asyncio.Event()
    wake.set()  # set before the wait: what it said is in the state the wait was computed from

    async def prompt_done() -> None:
        await asyncio.sleep(0.1)
        wake.set()

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    task = asyncio.create_task(prompt_done())
    seen: list[Head] = []
    claimed = await q.claim(block_ms=100, defer=lambda h: seen.append(h) or 5.0, wake=wake)
    await task
    assert claimed is not None and claimed.message.request_id == "new"
    assert seen[0].stage == "prefill" and seen[0].prefill_tokens == 300
    assert 0.1 <= loop.time() - t0 < 2.0
