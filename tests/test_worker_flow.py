"""Prefill and decode workers (sim engines, in-process) against a real redis-server.

The test plays the gateway with redis-py: subscribe to the request's token
channel, enqueue on a tier stream, read the frames.
"""

import asyncio

import pytest

from skyline.core import messages as m
from skyline.core.keys import Keys
from skyline.core.streams import enqueue, now_ms
from skyline.workers.engines.sim import SimTiming
from tests.inprocess import start_fleet, stop_fleet
from tests.procs import await_until

FAST = SimTiming(prefill_base_s=0.001, prefill_per_token_s=0.0, decode_base_s=0.001, decode_per_seq_s=0.0)


@pytest.fixture
async def fleet(redis_url, key_prefix):
    """One prefill and one decode worker running in this event loop."""
    cfg, client, runtimes, tasks = await start_fleet(redis_url, key_prefix, FAST, "test")
    yield cfg, client, runtimes
    await stop_fleet(client, runtimes, tasks)


def gen_request(rid: str, prompt: list[int], max_tokens: int, route: str = "disagg") -> m.GenerateRequest:
    t = now_ms()
    return m.GenerateRequest(rid, "skyline-sim", prompt, m.SamplingSpec(max_tokens=max_tokens), "interactive",
                             t, t + 1000, 1000, 250, route=route)


async def run_request(client, keys: Keys, req: m.GenerateRequest, timeout_s: float = 10,
                      enqueued: asyncio.Event | None = None) -> list:
    """Enqueue `req` (or decode work) as the gateway would; its frames up to the last."""
    return await run_work(client, keys, req if req.route == "disagg" else m.DecodeWork(request=req), timeout_s,
                          enqueued)


async def run_work(client, keys: Keys, work: m.GenerateRequest | m.DecodeWork, timeout_s: float = 10,
                   enqueued: asyncio.Event | None = None) -> list:
    """Enqueue a request on the prefill stream, or decode work on the decode stream; its frames.
    `enqueued` is set once it is in the stream (to order requests that share a FIFO tier stream)."""
    req = work.request if isinstance(work, m.DecodeWork) else work
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.tokens(req.request_id))
    await pubsub.get_message(timeout=1)  # subscribe confirmation
    await enqueue(client, keys, "decode" if isinstance(work, m.DecodeWork) else "prefill", work, 1000)
    if enqueued is not None:
        enqueued.set()
    frames = []
    async with asyncio.timeout(timeout_s):
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if msg is None:
                continue
            frames.append(m.decode(msg["data"]))
            if isinstance(frames[-1], (m.Finished, m.Failed)):
                break
    await pubsub.aclose()
    return frames


async def test_request_flows_prefill_to_decode_with_ordered_tokens(fleet):
    cfg, client, _ = fleet
    keys = Keys(cfg.key_prefix)
    frames = await run_request(client, keys, gen_request("r-disagg", list(b"hello world"), 40))
    deltas, final = frames[:-1], frames[-1]
    assert isinstance(final, m.Finished), final
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert [d.index for d in deltas] == [sum(len(x.token_ids) for x in deltas[:i]) for i in range(len(deltas))]
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == final.completion_tokens == 40
    assert final.prompt_tokens == len(b"hello world")
    assert (final.prefill_worker, final.decode_worker) == ("prefill-test", "decode-test")
    assert final.kv_transfer["remote_prefill"] is True
    # Everything was acked: nothing pending on any stream.
    for stage, _tier, key in keys.all_streams(cfg.tier_names):
        for g in await client.xinfo_groups(key):
            assert g["pending"] == 0, (key, g)


async def test_colocated_route_skips_the_prefill_pool_with_the_same_output(fleet):
    cfg, client, _ = fleet
    keys = Keys(cfg.key_prefix)
    prompt = list(b"same prompt")
    disagg = await run_request(client, keys, gen_request("r-a", prompt, 25))
    coloc = await run_request(client, keys, gen_request("r-b", prompt, 25, route="colocated"))
    text = lambda frames: "".join(f.text for f in frames if isinstance(f, m.TokenDelta))  # noqa: E731
    assert text(disagg) == text(coloc) and len(text(coloc)) == 25
    assert coloc[-1].prefill_worker == "" and coloc[-1].kv_transfer["remote_prefill"] is False


async def test_workers_heartbeat_their_role(fleet):
    from skyline.core.fleet import list_workers

    cfg, client, _ = fleet

    async def roles() -> dict[str, str]:
        return {w.worker_id: w.role for w in await list_workers(client, Keys(cfg.key_prefix), liveness_s=2)}

    async def both_beat() -> bool:
        return len(await roles()) >= 2

    await await_until(both_beat, 10, "both workers' first heartbeats")
    assert await roles() == {"prefill-test": "prefill", "decode-test": "decode"}


async def test_request_cancelled_while_queued_is_skipped(fleet):
    cfg, client, _ = fleet
    keys = Keys(cfg.key_prefix)
    await client.set(keys.cancelled("r-gone"), 1, ex=60)
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.tokens("r-gone"))
    await enqueue(client, keys, "prefill", gen_request("r-gone", [1, 2], 5), 1000)

    async def claimed_and_acked() -> bool:
        g = (await client.xinfo_groups(keys.stream("prefill", "interactive")))[0]
        return g["pending"] == 0 and g["last-delivered-id"] != b"0-0"

    await await_until(claimed_and_acked, 10, "the prefill worker to claim and ack the cancelled request")
    msgs = []
    while (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)) is not None:
        msgs.append(msg)
    await pubsub.aclose()
    assert msgs == []  # no tokens generated for a client that left
    g = (await client.xinfo_groups(keys.stream("prefill", "interactive")))[0]
    assert g["pending"] == 0 and g["last-delivered-id"] != b"0-0"  # claimed and acked, not left behind
    assert await client.xlen(keys.stream("decode", "interactive")) == 0  # never prefilled


async def test_cancel_broadcast_aborts_a_running_decode(fleet):
    cfg, client, (prefill_rt, decode_rt) = fleet
    keys = Keys(cfg.key_prefix)
    req = gen_request("r-long", [1, 2, 3], 100_000)
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.tokens(req.request_id))
    await enqueue(client, keys, "prefill", req, 1000)
    async with asyncio.timeout(5):
        while "r-long" not in decode_rt.held:
            await asyncio.sleep(0.01)
    await client.publish(keys.cancel, m.encode(m.Cancel("r-long")))
    async with asyncio.timeout(5):
        while "r-long" in decode_rt.held:
            await asyncio.sleep(0.01)
    assert decode_rt.engine.stats().running == 0
    await pubsub.aclose()


async def test_a_cancellation_dropped_on_its_way_still_stops_the_decode(fleet):
    """Python 3.11's asyncio.wait_for (inside redis-py's commands) drops a cancellation that lands
    as the awaited call completes. Here the decode task swallows it in its first Redis call, as
    wait_for would: the worker still stops the stream at its next chunk and acks the entry."""
    cfg, client, (_prefill_rt, decode_rt) = fleet
    keys = Keys(cfg.key_prefix)
    real_claim, entered, dropped = decode_rt.runs.claim, asyncio.Event(), asyncio.Event()

    async def claim_dropping_a_cancel(*args, **kwargs):
        entered.set()
        try:
            await asyncio.sleep(10)  # until the cancellation lands, which the test sends once it is in here
        except asyncio.CancelledError:
            dropped.set()
        return await real_claim(*args, **kwargs)

    decode_rt.runs.claim = claim_dropping_a_cancel
    decode_rt.take = None  # the run is claimed in the decode task, as for an entry taken over from a dead worker
    req = gen_request("r-dropped", [1, 2, 3], 100_000)
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.tokens(req.request_id))  # a listener: PUBLISH alone would not stop it
    await enqueue(client, keys, "prefill", req, 1000)
    await asyncio.wait_for(entered.wait(), 5)
    await client.publish(keys.cancel, m.encode(m.Cancel("r-dropped")))
    await await_until(dropped.is_set, 5, "the cancellation to reach the decode task inside its claim")
    async with asyncio.timeout(5):
        while "r-dropped" in decode_rt.held:
            await asyncio.sleep(0.01)
    assert decode_rt.counters["cancelled"] == 1 and decode_rt.engine.stats().running == 0
    g = (await client.xinfo_groups(keys.stream("decode", "interactive")))[0]
    assert g["pending"] == 0
    await pubsub.aclose()


async def test_a_handle_older_than_the_kv_lease_is_prefilled_locally(fleet):
    # vLLM may reuse the blocks of an expired lease; pulling them could give wrong output.
    cfg, client, _ = fleet
    keys = Keys(cfg.key_prefix)
    req = gen_request("r-stale", list(b"stale"), 8)
    stale = m.DecodeWork(request=req, kv_handle={"engine_id": "gone"}, prefill_worker="p",
                         prefill_started_ms=now_ms() - 70_000, prefill_finished_ms=now_ms() - 69_000)
    final = (await run_work(client, keys, stale))[-1]
    assert final.completion_tokens == 8
    assert final.kv_transfer["local_prefill"] == "handle_expired" and final.kv_transfer["remote_prefill"] is False


async def test_a_kv_pull_that_completes_past_the_handles_life_is_dropped_and_computed_here(redis_url, key_prefix):
    """The handle is young enough to pull when the decode worker takes it (47 s of a 48 s life: 80% of
    the 60 s lease), but the engine's first output, the pull's completion, comes 2 s later: the
    prefill engine may have reused the blocks meanwhile. That output never reaches the client; the
    prompt is computed here, with the same text as an undisturbed run, and says so."""
    slow = SimTiming(prefill_base_s=0.001, prefill_per_token_s=0.0, decode_base_s=2.0, decode_per_seq_s=0.0)
    cfg, client, runtimes, tasks = await start_fleet(redis_url, key_prefix, slow, "late")
    try:
        keys = Keys(cfg.key_prefix)
        want = await run_request(client, keys, gen_request("r-undisturbed", list(b"late pull"), 2, "colocated"))
        req = gen_request("r-late", list(b"late pull"), 2)
        late = m.DecodeWork(request=req, kv_handle={"engine_id": "prefill-engine"}, prefill_worker="prefill-late",
                            prefill_started_ms=now_ms() - 47_100, prefill_finished_ms=now_ms() - 47_000)
        frames = await run_work(client, keys, late, timeout_s=20)
    finally:
        await stop_fleet(client, runtimes, tasks)
    text = "".join(f.text for f in frames if isinstance(f, m.TokenDelta))
    assert text == "".join(f.text for f in want if isinstance(f, m.TokenDelta)) and len(text) == 2
    final = frames[-1]
    assert final.kv_transfer["local_prefill"] == "kv_pull_late" and final.kv_transfer["remote_prefill"] is False
    assert runtimes[1].metrics.pd_fallbacks.labels(reason="kv_pull_late")._value.get() == 1


async def test_a_colocated_prompt_leaves_the_backlog_at_its_first_token(fleet):
    # Admission control counts prompts not yet computed; a colocated request that is
    # streaming its answer is no longer work ahead of anyone.
    cfg, client, (_prefill_rt, decode_rt) = fleet
    keys = Keys(cfg.key_prefix)
    req = gen_request("r-coloc", list(b"a colocated prompt"), 300, route="colocated")
    pubsub = client.pubsub()
    await pubsub.subscribe(keys.tokens(req.request_id))  # a listener, or the worker aborts at once
    await enqueue(client, keys, "decode", m.DecodeWork(request=req, kv_handle=None), 1000)
    field = Keys.backlog_field("decode", "interactive")
    assert int(await client.hget(keys.backlog, field)) == len(req.prompt_token_ids)
    async with asyncio.timeout(5):
        while int(await client.hget(keys.backlog, field) or 0) != 0:
            await asyncio.sleep(0.01)
    assert "r-coloc" in decode_rt.held  # still streaming
    assert decode_rt.meter.tokens_per_s(now_ms()) > 0  # heartbeated: colocated admission uses it
    await client.publish(keys.cancel, m.encode(m.Cancel("r-coloc")))
    async with asyncio.timeout(5):
        while "r-coloc" in decode_rt.held:
            await asyncio.sleep(0.01)
    assert int(await client.hget(keys.backlog, field)) == 0  # released once, not again at the ack
    await pubsub.aclose()


def test_a_worker_whose_stop_hangs_ends_itself_and_logs_where():
    # The stop watchdog (workers/stop_watchdog.py): a stop that never completes ends the process with
    # status 1 and every task's and thread's stack in the log, instead of waiting for a SIGKILL
    # that leaves nothing to read.
    import subprocess
    import sys

    script = (
        "import asyncio\n"
        "from skyline.workers.stop_watchdog import StopWatchdog\n"
        "async def hangs_forever():\n"
        "    await asyncio.Event().wait()\n"
        "async def main():\n"
        "    StopWatchdog(asyncio.get_running_loop(), 0.2).start()\n"
        "    await hangs_forever()\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "did not stop within 0 s of the signal" in done.stderr
    assert "hangs_forever" in done.stderr  # the task's stack: where it hung
    assert "stop-watchdog" in done.stderr or "Thread 0x" in done.stderr  # the threads' stacks
