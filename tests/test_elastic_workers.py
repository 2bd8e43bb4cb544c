"""Elastic workers (scheduler/elastic.py): every engine takes either phase. Sim engines in-process
against a real redis-server; the test plays the gateway with redis-py, as tests/test_worker_flow.py."""

import asyncio

from skyline.core import messages as m
from skyline.core.keys import Keys
from skyline.core.timeline import read_timeline
from skyline.workers.engines.sim import SimTiming
from tests.inprocess import start_fleet, stop_fleet, wait_registered
from skyline.core.streams import now_ms
from skyline.scheduler.claiming import LONG_PROMPT_MEMORY_S
from tests.test_worker_flow import gen_request, run_request

# A prompt token costs 1 ms, a decode step 20 ms: prompts and streams overlap as on a real engine.
TIMING = SimTiming(prefill_base_s=0.005, prefill_per_token_s=0.001, decode_base_s=0.02, decode_per_seq_s=0.0)


async def _serve_all(client, keys, reqs) -> list[list]:
    return await asyncio.gather(*(run_request(client, keys, r, timeout_s=30) for r in reqs))


def _tokens(frames) -> list[int]:
    return [t for f in frames if isinstance(f, m.TokenDelta) for t in f.token_ids]


async def test_two_elastic_workers_serve_both_routes_exactly_once_and_both_engines_work(redis_url, key_prefix):
    cfg, client, rts, tasks = await start_fleet(redis_url, key_prefix, TIMING, "t", roles=("elastic", "elastic"))
    keys = Keys(key_prefix)
    try:
        await wait_registered(client, key_prefix, 2)
        for rt in rts:  # each knows its peer before the first prompt is placed
            while len(rt.peers) < 2:
                await asyncio.sleep(0.05)
        # The prefill streams' prompts, each under a step (256 tokens): while both engines compute one, each
        # still has room in its next step for a hand-off (`decoder_for`'s step room); with longer ones both
        # engines, claiming as soon as no peer would be free sooner (the claim defer), rarely do.
        reqs = [gen_request(f"long-{i}", list(range(1, 200)), 12) for i in range(6)]
        reqs += [gen_request(f"short-{i}", list(range(1, 30)), 12, route="colocated") for i in range(10)]
        results = await _serve_all(client, keys, reqs)
        for req, frames in zip(reqs, results):
            assert isinstance(frames[-1], m.Finished), (req.request_id, frames[-1])
            assert len(_tokens(frames)) == 12, req.request_id  # every token once, none twice
        finals = {r.request_id: f[-1] for r, f in zip(reqs, results)}
        decoders = {f.decode_worker for f in finals.values()}
        assert decoders == {rt.worker_id for rt in rts}, "one engine idled while requests waited"
        # Some prompt was computed on one engine and decoded on the other (its KV handed over)...
        split = [f for f in finals.values() if f.prefill_worker and f.prefill_worker != f.decode_worker]
        assert split, "no prompt's decode was handed to the peer"
        # ... and the rest of the long prompts were served whole where they were computed.
        for rid, f in finals.items():
            if rid.startswith("long") and not f.prefill_worker:
                assert f.kv_transfer.get("local_prefill", "") == "", f
        # Each placement is in the request's timeline, saying where and why.
        events = await read_timeline(client, keys, "long-0")
        placed = [e for e in events if e.event == "decode_placed"]
        assert placed and placed[0].fields["on"] in {rt.worker_id for rt in rts} and placed[0].fields["why"]
        for f in split:  # the response says why the decode moved
            assert f.kv_transfer["decode_placed"] in ("peer_decodes_fewer", "prompts_queued"), f.kv_transfer
        # Nothing is left held, pending or queued.
        await _wait_released(rts)
        for stage in ("prefill", "decode"):
            for tier in cfg.tier_names:
                for key in (keys.stream(stage, tier), keys.retry_stream(stage, tier)):
                    pending = await client.xpending(key, Keys.group(stage))
                    assert pending["pending"] == 0, (key, pending)
    finally:
        await stop_fleet(client, rts, tasks)


async def _wait_released(rts, within_s: float = 5.0) -> None:
    """Every worker holds nothing, once it has let go of what it served: a worker acks and drops a request
    just after publishing its last frame, so a client can see the end a moment before the worker forgets it."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not all(len(rt.held) == 0 for rt in rts) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    for rt in rts:
        assert len(rt.held) == 0 and rt.held.prompt_tokens == 0, (rt.worker_id, len(rt.held))


def _peer(wid: str, running: int, role: str = "elastic", max_running: int = 8, kv: float = 0.0, computing: int = 0):
    from types import SimpleNamespace

    return SimpleNamespace(worker_id=wid, role=role, running=running, max_running=max_running, kv_usage=kv,
                           kv_watermark=0.9, running_tokens=computing)


def test_the_decode_goes_to_a_peer_only_when_it_decodes_fewer_streams_or_prompts_wait():
    from skyline.scheduler.elastic import decoder_for, serves

    me = "a"
    assert decoder_for(me, 3, [_peer("b", 1)], False) == ("b", "peer_decodes_fewer")
    assert decoder_for(me, 2, [_peer("b", 2)], False) == (None, "fewest_streams_here")  # no gain: no KV moves
    assert decoder_for(me, 2, [_peer("b", 2)], True) == ("b", "prompts_queued")  # keep this engine for prompts
    assert decoder_for(me, 1, [_peer("b", 2)], True) == (None, "fewest_streams_here")
    assert decoder_for(me, 0, [], True) == (None, "no_peer_with_room")
    assert decoder_for(me, 5, [_peer("b", 8)], True) == (None, "no_peer_with_room")  # full
    assert decoder_for(me, 5, [_peer("b", 1, kv=0.95)], True) == (None, "no_peer_with_room")  # KV past its watermark
    assert decoder_for(me, 5, [_peer("b", 1, role="prefill")], True) == (None, "no_peer_with_room")
    assert decoder_for(me, 5, [_peer("a", 0), _peer("b", 3), _peer("c", 1), _peer("d", 1)], False) == ("c", "peer_decodes_fewer")
    assert decoder_for(me, 5, [_peer("d", 2, role="decode")], False) == ("d", "peer_decodes_fewer")
    # A peer computing a full prompt budget would not claim the hand-off: the engine that computed the
    # prompt would take it back. Of peers with room, the one computing fewer prompt tokens.
    assert decoder_for(me, 5, [_peer("b", 1, computing=2048)], True, 2048) == (None, "no_peer_with_room")
    assert decoder_for(me, 5, [_peer("b", 1, computing=1024), _peer("c", 1)], True, 2048) == ("c", "peer_decodes_fewer")
    # A peer whose own prompts fill its next step would start the hand-off only after them.
    assert decoder_for(me, 5, [_peer("b", 1, computing=256)], True, 2048, step_tokens=256) == (None, "no_peer_with_room")
    assert decoder_for(me, 5, [_peer("b", 1, computing=128)], True, 2048, step_tokens=256) == ("b", "peer_decodes_fewer")
    # A prompt too short to be worth its KV move stays where it was computed.
    assert decoder_for(me, 5, [_peer("b", 1)], True, prompt_tokens=158, min_move_tokens=256) == (None, "too_short_to_move")
    assert decoder_for(me, 5, [_peer("b", 1)], True, prompt_tokens=256, min_move_tokens=256) == ("b", "peer_decodes_fewer")
    assert [s for s in ("prefill", "decode") if serves("elastic", s)] == ["prefill", "decode"]
    assert not serves("prefill", "decode") and not serves("decode", "prefill")


async def test_an_elastic_worker_that_takes_back_its_own_hand_off_decodes_from_its_prefix_cache(redis_url, key_prefix):
    # vLLM cannot pull KV from its own engine (it refuses to register itself as a remote): a hand-off
    # no peer claimed in time and its own worker took back is computed here, its blocks found cached.
    from skyline.workers.decode import DecodeHandler
    from skyline.workers.runs import RunClaim
    from skyline.workers.runtime import WorkerRuntime
    from tests.test_rules_shared import _Engine, _config

    from dataclasses import replace

    cfg = _config("elastic")
    cfg = replace(cfg, key_prefix=key_prefix, redis=replace(cfg.redis, url=redis_url),
                  worker=replace(cfg.worker, heartbeat_s=1.0))
    rt = WorkerRuntime(cfg, _Engine(), "m")
    assert rt.elastic and rt.stages == ("decode", "prefill")
    handler = DecodeHandler(rt.port)
    req = gen_request("own", list(range(1, 400)), 4)
    fresh = RunClaim(attempt=1, done=False, frames=0, output=[])
    from skyline.core.streams import now_ms

    own = m.DecodeWork(req, kv_handle={"kv": 1}, prefill_worker=rt.worker_id, prefill_finished_ms=now_ms())
    _ereq, handle, why = await handler._plan(own, fresh)
    assert handle is None and why == "own_handoff"
    peer = m.DecodeWork(req, kv_handle={"kv": 1}, prefill_worker="elastic-peer", prefill_finished_ms=now_ms())
    _ereq, handle, why = await handler._plan(peer, fresh)
    assert handle == {"kv": 1} and why == ""
    await rt.redis.aclose()


async def _undelivered_shared_work(client, keys: Keys, tiers) -> bool:
    """Is an entry waiting in a shared stream (any stage, tier, retry lane) that no worker has claimed?
    A worker's own affinity lane is left out: an entry placed there waits for that worker by design."""
    for stage in ("prefill", "decode"):
        for tier in tiers:
            for key in (keys.stream(stage, tier), keys.retry_stream(stage, tier)):
                if not await client.exists(key):
                    continue
                for g in await client.xinfo_groups(key):
                    if g["name"].decode() != Keys.group(stage):
                        continue
                    last = g["last-delivered-id"].decode()
                    if await client.xrange(key, min="(" + last, count=1):
                        return True
    return False


async def test_four_elastic_workers_under_mixed_load_leave_no_engine_idle_while_work_waits(redis_url, key_prefix):
    """Waves of long prompts (computed on one engine, decoded where streams are fewest) and short ones
    (served whole) on four elastic workers: every request once, every engine used, and no sample in
    which work sat unclaimed in a shared stream while some engine held nothing, for longer than a
    quarter second; nothing left pending, no KV handed off without its pull."""
    cfg, client, rts, tasks = await start_fleet(redis_url, key_prefix, TIMING, "m", roles=("elastic",) * 4)
    keys = Keys(key_prefix)
    idle_while_waiting: list[tuple] = []  # each violating sample: seconds since start, who idled, the engines
    stop = asyncio.Event()

    async def watch() -> None:
        # Sampled every 20 ms: a violation is one that lasts 250 ms of wall time. A worker wakes on an
        # entry within a loop turn; a busy one claims a prompt only when no peer, as its last heartbeat
        # said, frees sooner than its own step ends (the claim defer), so a prompt queued behind a step
        # while a peer idles is the heartbeats' error, not a whole prompt's time (600 ms here). Two
        # prompts one step computes together are both running, as in vLLM.
        loop = asyncio.get_running_loop()
        t0, since = loop.time(), None
        while not stop.is_set():
            idle = [rt for rt in rts if len(rt.held) == 0]
            # Work waits in a shared stream, or claimed by an engine that has not started it: prompts queued
            # behind its current step (`waiting`, as vLLM counts it; a prompt a step computes is running).
            hoarded = [rt.worker_id for rt in rts if rt.engine.stats().waiting > 0]
            waiting = bool(idle) and (bool(hoarded) or await _undelivered_shared_work(client, keys, cfg.tier_names))
            now = loop.time()
            since = (since or now) if waiting else None
            if since is not None and now - since >= 0.25:
                # (when, the idle engines, and each engine's prompts queued, running and requests held)
                idle_while_waiting.append((round(now - t0, 3), [rt.worker_id for rt in idle],
                                           [(rt.worker_id, rt.engine.stats().waiting, rt.engine.stats().running,
                                             len(rt.held)) for rt in rts]))
            await asyncio.sleep(0.02)

    try:
        await wait_registered(client, key_prefix, 4)
        for rt in rts:
            while len(rt.peers) < 4:
                await asyncio.sleep(0.05)
        watcher = asyncio.create_task(watch())

        async def wave(w: int) -> list[list]:
            await asyncio.sleep(0.4 * w)
            reqs = [gen_request(f"w{w}-long-{i}", list(range(1 + w, 600 + w)), 16) for i in range(4)]
            reqs += [gen_request(f"w{w}-short-{i}", list(range(1 + i, 40 + i)), 16, route="colocated")
                     for i in range(8)]
            return list(zip(reqs, await asyncio.gather(*(run_request(client, keys, r, timeout_s=60) for r in reqs))))

        served = [pair for w in await asyncio.gather(*(wave(w) for w in range(3))) for pair in w]
        stop.set()
        await watcher
        assert len(served) == 36
        for req, frames in served:
            assert isinstance(frames[-1], m.Finished), (req.request_id, frames[-1])
            assert len(_tokens(frames)) == 16, req.request_id  # every token once, none twice
        finals = [f[-1] for _r, f in served]
        assert {f.decode_worker for f in finals} == {rt.worker_id for rt in rts}, "an engine never decoded"
        computed = {f.prefill_worker or f.decode_worker for f in finals}
        assert computed == {rt.worker_id for rt in rts}, "an engine never computed a prompt"
        assert not idle_while_waiting, f"work waited while an engine held nothing: {idle_while_waiting[:3]}"
        # A decode placed on a peer pulled the prompt's KV from the engine that computed it, once.
        for f in finals:
            if f.prefill_worker and f.prefill_worker != f.decode_worker:
                assert f.kv_transfer["remote_prefill"] is True, f.kv_transfer
        # Nothing is held, pending, or left on the backlog admission control reads.
        await _wait_released(rts)
        for stage, _tier, key in keys.all_streams(cfg.tier_names):
            for g in await client.xinfo_groups(key):
                assert g["pending"] == 0, (key, g)
        backlog = {k.decode(): int(v) for k, v in (await client.hgetall(keys.backlog)).items()}
        assert all(v == 0 for v in backlog.values()), backlog
    finally:
        stop.set()
        await stop_fleet(client, rts, tasks)


def test_hand_offs_spread_over_peers_when_every_worker_reads_the_same_heartbeats():
    """Two random choices per request: with many equally loaded peers, hand-offs from one view land on
    many of them, not on the first of the least loaded; with two peers, the better one as before."""
    from collections import Counter

    from skyline.scheduler.elastic import decoder_for

    view = [_peer(f"p{i}", 2 if i % 4 else 1) for i in range(64)]  # 16 peers decode 1 stream, 48 decode 2
    picks = Counter(decoder_for("me", 6, view, False, 0, spread=f"req-{n}")[0] for n in range(1000))
    assert len(picks) > 40 and max(picks.values()) < 60, picks.most_common(3)
    lighter = sum(c for wid, c in picks.items() if int(wid[1:]) % 4 == 0)
    assert lighter > 1000 * 16 / 64, "the lighter peers are not favoured"  # above their share of the view
    assert decoder_for("me", 6, view, False, 0, spread="req-1") == decoder_for("me", 6, view, False, 0, spread="req-1")
    # Two peers: always the less loaded one, whatever the request.
    pair = [_peer("b", 3), _peer("c", 1)]
    assert {decoder_for("me", 5, pair, False, 0, spread=f"r{n}")[0] for n in range(50)} == {"c"}
    assert decoder_for("me", 5, view, False, 0)[0] == "p0"  # no key: the best of all, the first of equals


async def test_a_hand_off_is_decoded_here_when_its_peer_has_started_a_long_prompt_since_the_last_beat(redis_url,
                                                                                                       key_prefix):
    """The peer is chosen on heartbeats up to two beats old (`_place_decode`); before computing the prompt for
    it, the worker reads the peer's newest beat (which a worker announces as it starts a prompt, not at its
    next beat): a peer computing a step's worth of prompt tokens would start the pull only after them."""
    from dataclasses import replace

    from skyline.core.fleet import WorkerInfo, heartbeat, read_worker
    from skyline.core.streams import Claimed
    from skyline.workers.held import HeldRequest, Phase
    from skyline.workers.runtime import WorkerRuntime
    from tests.test_rules_shared import _Engine, _config

    cfg = _config("elastic")
    cfg = replace(cfg, key_prefix=key_prefix, redis=replace(cfg.redis, url=redis_url))
    rt = WorkerRuntime(cfg, _Engine(), "m")
    step = cfg.engine.max_num_batched_tokens

    def placed(rid: str) -> HeldRequest:
        req = gen_request(rid, list(range(1, 300)), 4)
        held = HeldRequest.of(Claimed("stream", "0-1", req.tier, req), Phase.COMPUTING)
        held.serve_as, held.decode_on, held.decode_placed = "prefill", "elastic-peer", "peer_decodes_fewer"
        return held

    async def beat(computing: int) -> None:
        await heartbeat(rt.redis, rt.keys, WorkerInfo(
            worker_id="elastic-peer", role="elastic", engine="sim", model="m", host="h", pid=1, running=1, waiting=0,
            kv_usage=0.0, started=0.0, last_seen=0.0, running_tokens=computing, max_running=8), 3)

    try:
        await beat(computing=step // 2)  # a short prompt leaves room in its next step: the hand-off stands
        kept = placed("kept")
        await rt._confirm_decoder(kept)
        assert (kept.serve_as, kept.decode_on) == ("prefill", "elastic-peer")
        await beat(computing=1_500)  # it has claimed a RAG prompt since
        here = placed("here")
        await rt._confirm_decoder(here)
        assert (here.serve_as, here.decode_on, here.decode_placed) == ("decode", None, "peer_busy_now")
        await rt.redis.delete(rt.keys.worker("elastic-peer"))  # gone
        gone = placed("gone")
        await rt._confirm_decoder(gone)
        assert gone.serve_as == "decode"
        # A worker that starts a prompt announces it between beats: its peers read it at once.
        rt.held.add(placed("mine"))
        await rt._announce()
        assert (await read_worker(rt.redis, rt.keys, rt.worker_id)).running_tokens == 299
    finally:
        await rt.redis.aclose()


def _timed_request(rid: str, prompt_tokens: int, max_tokens: int, due_in_ms: int, tpot_ms: int) -> m.GenerateRequest:
    t = now_ms()
    return m.GenerateRequest(rid, "skyline-sim", list(range(1, prompt_tokens + 1)),
                             m.SamplingSpec(max_tokens=max_tokens), "interactive", t, t + due_in_ms, due_in_ms, tpot_ms,
                             route="colocated")


async def test_the_pace_rule_holds_a_request_back_only_until_its_latest_start(redis_url, key_prefix):
    """An engine whose streams run slower than their TPOT targets allow (the pace rule,
    scheduler/decode_room.py) claims no new work, except a request that must start now to meet its TTFT
    deadline: past its latest start, waiting would only make it late."""
    cfg, client, rts, tasks = await start_fleet(redis_url, key_prefix, TIMING, "p", roles=("elastic",))
    keys = Keys(key_prefix)
    done: dict[str, float] = {}

    async def serve(req: m.GenerateRequest, enqueued: asyncio.Event | None = None) -> list:
        frames = await run_request(client, keys, req, timeout_s=30, enqueued=enqueued)
        done[req.request_id] = asyncio.get_running_loop().time()
        return frames

    try:
        await wait_registered(client, key_prefix, 1)
        # Two streams with a 1 ms TPOT target, ~4 s of 20 ms steps: the engine is paced out while they run.
        streams = [asyncio.create_task(serve(_timed_request(f"stream-{i}", 20, 200, 5_000, 1))) for i in range(2)]
        for _ in range(200):
            if len(rts[0].held) == 2 and not rts[0].has_room():
                break
            await asyncio.sleep(0.05)
        assert not rts[0].has_room(), "the streams never ran slower than their targets"
        # A claim that began with room waits up to 500 ms for an entry (`TierQueues.claim`): let it end.
        await asyncio.sleep(0.6)
        # Due in 40 ms (its latest start is now) and due in a minute (it can wait for a stream to end).
        # Both share a FIFO tier stream, in deadline order as one tier's requests are: due-now goes first.
        due_enqueued = asyncio.Event()
        due = asyncio.create_task(serve(_timed_request("due-now", 10, 1, 40, 250), due_enqueued))
        await due_enqueued.wait()
        later = asyncio.create_task(serve(_timed_request("due-later", 10, 1, 60_000, 250)))
        results = await asyncio.gather(*streams, due, later)
        assert all(isinstance(frames[-1], m.Finished) for frames in results), [f[-1] for f in results]
        first_stream_done = min(done["stream-0"], done["stream-1"])
        assert done["due-now"] < first_stream_done - 1.0, done  # claimed while paced out
        assert done["due-later"] > first_stream_done, done  # held back until the engine had room
    finally:
        await stop_fleet(client, rts, tasks)


async def test_long_prompts_gather_on_the_engine_that_computes_them_and_short_ones_keep_off_it(redis_url, key_prefix):
    """Long prompts (the prefill streams') go where long prompts are computed, and short ones to the engine
    that computes none while it holds fewer requests (scheduler/claiming.py `leaves_until_due`): the
    disaggregated split, found by the engines. Before, the idle engine took the next long prompt at once, so that both engines ended up
    computing long prompts beside chats' streams."""
    cfg, client, rts, tasks = await start_fleet(redis_url, key_prefix, TIMING, "g", roles=("elastic", "elastic"),
                                                long_prompt_memory_s=LONG_PROMPT_MEMORY_S, phase_mix=False)
    keys = Keys(key_prefix)

    def long_request(rid: str) -> m.GenerateRequest:  # 1,500 tokens: 1.5 s of prompt; due in a minute
        t = now_ms()
        return m.GenerateRequest(rid, "skyline-sim", list(range(1, 1501)), m.SamplingSpec(max_tokens=4),
                                 "interactive", t, t + 60_000, 60_000, 250, route="disagg")

    def computed_on(frames) -> str:
        final = frames[-1]
        assert isinstance(final, m.Finished), final
        return final.prefill_worker or final.decode_worker

    try:
        await wait_registered(client, key_prefix, 2)
        for rt in rts:
            while len(rt.peers) < 2:
                await asyncio.sleep(0.05)
        first = asyncio.create_task(run_request(client, keys, long_request("long-0"), timeout_s=30))
        holder = other = None
        for _ in range(200):  # until one engine computes it and its peer has seen so in a heartbeat
            holder = next((rt for rt in rts if "long-0" in {h.request_id for h in rt.held}), None)
            other = next((rt for rt in rts if rt is not holder), None)
            if holder is not None and other.freest.free_at_with_long(other.worker_id, "prefill") is not None:
                break
            await asyncio.sleep(0.02)
        assert holder is not None and other.freest.free_at_with_long(other.worker_id, "prefill") is not None
        # The other engine is idle; the next long prompt still goes where the first is computed...
        second = await run_request(client, keys, long_request("long-1"), timeout_s=30)
        assert computed_on(second) == holder.worker_id
        assert computed_on(await first) == holder.worker_id
        # ... and a short prompt (the colocated route) to the engine that computes none while it holds fewer
        # requests: sent while a third long prompt is held where they gather, once the holder has seen in a
        # heartbeat that the other engine holds nothing.
        third = asyncio.create_task(run_request(client, keys, long_request("long-2"), timeout_s=30))
        for _ in range(300):
            if "long-2" in {h.request_id for h in holder.held} and \
                    (holder.freest.least_held_without_long(holder.worker_id, "decode") or (1,))[0] == 0:
                break
            await asyncio.sleep(0.02)
        chat = await run_request(client, keys, gen_request("chat", list(range(1, 30)), 4, route="colocated"),
                                 timeout_s=30)
        assert computed_on(chat) == other.worker_id
        assert computed_on(await third) == holder.worker_id
    finally:
        await stop_fleet(client, rts, tasks)


async def test_the_phase_mix_keeps_long_prompts_on_one_engine_and_their_streams_on_the_other(redis_url, key_prefix):
    """With long and short prompts in the load, the fleet's phase mix (scheduler/elastic.py `long_engines`)
    picks the engine that computed the long prompt to keep them: it hands every decode on to the other
    engine, and a chat sent while it computes a long prompt goes to the other engine."""
    cfg, client, rts, tasks = await start_fleet(redis_url, key_prefix, TIMING, "g", roles=("elastic", "elastic"))
    keys = Keys(key_prefix)

    def long_request(rid: str, first: int) -> m.GenerateRequest:  # 1,500 tokens: 1.5 s of prompt; due in a minute
        t = now_ms()  # (prompts that share no prefix: a cached one would be computed at once)
        return m.GenerateRequest(rid, "skyline-sim", list(range(first, first + 1500)), m.SamplingSpec(max_tokens=4),
                                 "interactive", t, t + 60_000, 60_000, 250, route="disagg")

    def final(frames) -> m.Finished:
        assert isinstance(frames[-1], m.Finished), frames[-1]
        return frames[-1]

    try:
        await wait_registered(client, key_prefix, 2)
        assert all(rt.phase_mix for rt in rts)
        # One kind of prompt only: no split.
        await run_request(client, keys, gen_request("chat-0", list(range(1, 30)), 4, route="colocated"), timeout_s=30)
        first = final(await run_request(client, keys, long_request("long-0", 1), timeout_s=30))
        holder_id = first.prefill_worker or first.decode_worker
        for _ in range(300):  # until both have seen both kinds in each other's heartbeats
            if all(rt.long_set == {holder_id} for rt in rts):
                break
            await asyncio.sleep(0.02)
        assert all(rt.long_set == {holder_id} for rt in rts), [rt.long_set for rt in rts]
        holder = next(rt for rt in rts if rt.worker_id == holder_id)
        other = next(rt for rt in rts if rt is not holder)
        async def held_by_either(rid: str) -> None:
            for _ in range(300):
                if any(rid in {h.request_id for h in rt.held} for rt in rts):
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{rid} was not claimed")

        second = asyncio.create_task(run_request(client, keys, long_request("long-1", 5001), timeout_s=30))
        await held_by_either("long-1")
        mine_id, mine = "long-1", second
        if "long-1" in {h.request_id for h in other.held}:
            # Both engines were idle, and an engine holding nothing leaves nothing (it finishes it first):
            # the other one took it. Now it computes, so the next long prompt is left to the long engine.
            mine_id = "long-2"
            mine = asyncio.create_task(run_request(client, keys, long_request("long-2", 9001), timeout_s=30))
            await held_by_either(mine_id)
        assert mine_id in {h.request_id for h in holder.held}
        chat = final(await run_request(client, keys, gen_request("chat-1", list(range(1, 30)), 4,
                                                                  route="colocated"), timeout_s=30))
        assert chat.decode_worker == other.worker_id and not chat.prefill_worker
        done = final(await mine)
        assert (done.prefill_worker, done.decode_worker) == (holder.worker_id, other.worker_id)
        final(await second)
        placed = [e for e in await read_timeline(client, keys, mine_id) if e.event == "decode_placed"]
        assert placed and placed[0].fields["why"] == "long_prompts_here", placed
        assert done.kv_transfer["decode_placed"] == "long_prompts_here", done.kv_transfer
    finally:
        await stop_fleet(client, rts, tasks)
