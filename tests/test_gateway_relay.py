"""The token relay against a real Redis: confirmed subscriptions, routing, duplicates, breakage,
and resuming streams from their frame logs after a lost connection."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from skyline.core import messages
from skyline.core.keys import Keys
from skyline.gateway import resume
from skyline.gateway.relay import Relay, RelayUnavailable, Subscription
from skyline.workers.runs import Runs


@pytest.fixture
async def relay(redis_url, key_prefix):
    rl = Relay(redis_url, Keys(key_prefix), ping_interval_s=0.5)
    await rl.start()
    yield rl
    await rl.close()


@pytest.fixture
async def r(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


def delta(rid: str, seq: int, text: str) -> bytes:
    return messages.encode(messages.TokenDelta(rid, seq, seq, [ord(c) for c in text], text))


async def next_frame(sub, timeout: float = 2.0) -> messages.Message:
    async with asyncio.timeout(timeout):
        return await sub.get()


async def test_subscribe_is_confirmed_before_it_returns(relay, r, key_prefix):
    keys = Keys(key_prefix)
    for i in range(20):
        rid = f"cmpl-{i}"
        sub = await relay.subscribe(rid)
        # Published the instant subscribe() returned: Redis must already count our subscriber.
        assert await r.publish(keys.tokens(rid), delta(rid, 0, "x")) == 1
        assert (await next_frame(sub)).text == "x"
        relay.unsubscribe(sub)


async def test_frames_go_to_their_own_request(relay, r, key_prefix):
    keys = Keys(key_prefix)
    subs = {rid: await relay.subscribe(rid) for rid in ("a", "b", "c")}
    for seq in range(3):
        for rid in subs:
            await r.publish(keys.tokens(rid), delta(rid, seq, f"{rid}{seq}"))
    for rid, sub in subs.items():
        got = [(await next_frame(sub)).text for _ in range(3)]
        assert got == [f"{rid}0", f"{rid}1", f"{rid}2"]
        assert sub.get_nowait() is None


async def test_duplicates_dropped_and_terminal_frame_ends(relay, r, key_prefix):
    keys = Keys(key_prefix)
    sub = await relay.subscribe("dup")
    ch = keys.tokens("dup")
    for payload in (delta("dup", 0, "a"), delta("dup", 0, "a"), delta("dup", 1, "b"), delta("dup", 0, "a"),
                    messages.encode(messages.Finished("dup", 2, "stop", 3, 2)),
                    delta("dup", 3, "late"), b"not msgpack at all"):
        await r.publish(ch, payload)
    frames = [await next_frame(sub) for _ in range(3)]
    assert [type(f).__name__ for f in frames] == ["TokenDelta", "TokenDelta", "Finished"]
    assert [f.seq for f in frames] == [0, 1, 2]
    await asyncio.sleep(0.1)
    assert sub.get_nowait() is None and sub.duplicates == 2


async def test_unsubscribe_leaves_no_subscription(relay, r, key_prefix):
    keys = Keys(key_prefix)
    sub = await relay.subscribe("gone")
    relay.unsubscribe(sub)
    for _ in range(50):
        if (await r.pubsub_numsub(keys.tokens("gone")))[0][1] == 0:
            break
        await asyncio.sleep(0.02)
    assert (await r.pubsub_numsub(keys.tokens("gone")))[0][1] == 0
    assert relay.in_flight == 0


async def test_broken_connection_fails_in_flight_then_recovers(redis_url, r, key_prefix):
    # Without a grace (outage_grace_s = 0) a lost connection fails every request in flight at once.
    keys = Keys(key_prefix)
    relay = Relay(redis_url, keys, ping_interval_s=0.5, resume_s=0)
    await relay.start()
    subs = [await relay.subscribe(f"live-{i}") for i in range(3)]
    await r.publish(keys.tokens("live-0"), delta("live-0", 0, "a"))
    assert (await next_frame(subs[0])).text == "a"
    clients = await r.client_list()
    mine = [c for c in clients if c.get("name") == relay.client_name]
    assert len(mine) == 1
    await r.client_kill_filter(_id=mine[0]["id"])
    for sub in subs:
        frame = await next_frame(sub)
        assert isinstance(frame, messages.Failed) and frame.status == 502 and "pub/sub" in frame.message
        assert sub.aborted
    # It reconnects by itself, and new requests work again.
    for _ in range(100):
        if relay.connected:
            break
        await asyncio.sleep(0.05)
    sub = await relay.subscribe("after")
    assert await r.publish(keys.tokens("after"), delta("after", 0, "ok")) == 1
    assert (await next_frame(sub)).text == "ok"
    await relay.close()


async def test_subscribe_refused_while_disconnected(redis_url, key_prefix):
    rl = Relay("redis://127.0.0.1:1/0", Keys(key_prefix))
    with pytest.raises(RelayUnavailable):
        await rl.start(timeout_s=0.5)
    with pytest.raises(RelayUnavailable):
        await rl.subscribe("x")


async def test_slow_reader_gets_an_error_not_a_gap(redis_url, r, key_prefix):
    keys = Keys(key_prefix)
    rl = Relay(redis_url, keys, queue_size=4)
    await rl.start()
    try:
        sub = await rl.subscribe("slow")
        for seq in range(10):
            await r.publish(keys.tokens("slow"), delta("slow", seq, "t"))
        frame = await next_frame(sub)
        assert isinstance(frame, messages.Failed) and frame.code == "client_too_slow"
        assert sub.aborted
    finally:
        await rl.close()


# ---- resuming after a lost connection ------------------------------------------------------


class Gate:
    """Holds the relay's reconnection until the test opens it: the frames published meanwhile
    reach nobody, as while Redis restarts."""

    def __init__(self, relay: Relay):
        self.open = asyncio.Event()
        real = relay._connect

        async def gated():
            await self.open.wait()
            return await real()

        relay._connect = gated


async def kill_relay_connection(relay: Relay, r) -> None:
    mine = [c for c in await r.client_list() if c.get("name") == relay.client_name]
    await r.client_kill_filter(_id=mine[0]["id"])
    for _ in range(100):
        if not relay.connected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the relay did not notice its connection was gone")


async def wait_connected(relay: Relay) -> None:
    for _ in range(200):
        if relay.connected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the relay did not reconnect")


async def test_a_lost_connection_resumes_every_stream_from_its_frame_log(redis_url, r, key_prefix):
    keys = Keys(key_prefix)
    relay = Relay(redis_url, keys, ping_interval_s=0.5, resume_s=5)
    await relay.start()
    runs = Runs(r, keys, ttl_s=60)
    try:
        started, queued = await relay.subscribe("mid"), await relay.subscribe("queued")
        await runs.claim("mid", "decode-a")

        async def publish(rid: str, seq: int, frame: messages.Message, final: bool = False) -> int:
            k, a = runs.publish_args(rid, 1, keys.tokens(rid), messages.encode(frame), final, [seq], seq)
            return await runs.publish_script(keys=k, args=a)

        assert await publish("mid", 0, messages.TokenDelta("mid", 0, 0, [0], "a")) == 1
        assert (await next_frame(started)).text == "a"
        gate = Gate(relay)
        await kill_relay_connection(relay, r)
        # Published while nobody listens: only the frame log has them.
        assert await publish("mid", 1, messages.TokenDelta("mid", 1, 1, [1], "b")) == 0
        assert await publish("mid", 2, messages.TokenDelta("mid", 2, 2, [2], "c")) == 0
        with pytest.raises(RelayUnavailable):  # new requests: 503 at the door meanwhile
            await relay.subscribe("new")
        gate.open.set()
        await wait_connected(relay)
        for _ in range(100):  # re-subscribed: the live frames reach it again
            if (await r.pubsub_numsub(keys.tokens("mid")))[0][1] == 1:
                break
            await asyncio.sleep(0.02)
        assert await publish("mid", 3, messages.TokenDelta("mid", 3, 3, [3], "d")) == 1
        assert await publish("mid", 4, messages.Finished("mid", 4, "stop", 1, 4), final=True) == 1
        frames = [await next_frame(started) for _ in range(4)]
        assert [f.seq for f in frames] == [1, 2, 3, 4] and "".join(f.text for f in frames[:3]) == "bcd"
        assert isinstance(frames[-1], messages.Finished) and not started.aborted
        # A request still queued (nothing delivered, no run state yet) keeps waiting, and is served.
        await runs.claim("queued", "decode-a")
        assert await publish("queued", 0, messages.Finished("queued", 0, "stop", 1, 0), final=True) == 1
        assert isinstance(await next_frame(queued), messages.Finished)
        await asyncio.sleep(0.1)
        assert started.get_nowait() is None and queued.get_nowait() is None
    finally:
        await relay.close()


async def test_requests_whose_state_redis_lost_fail_explicitly(redis_url, r, key_prefix):
    keys = Keys(key_prefix)
    relay = Relay(redis_url, keys, ping_interval_s=0.5, resume_s=5)
    await relay.start()
    runs = Runs(r, keys, ttl_s=60)
    try:
        for _ in range(100):  # the relay has read the epoch it will compare with
            if relay._epoch is not None:
                break
            await asyncio.sleep(0.02)
        started, queued = await relay.subscribe("s-mid"), await relay.subscribe("s-queued")
        await runs.claim("s-mid", "decode-a")
        k, a = runs.publish_args("s-mid", 1, keys.tokens("s-mid"), delta("s-mid", 0, "a"), False, [97], 0)
        assert await runs.publish_script(keys=k, args=a) == 1
        assert (await next_frame(started)).text == "a"
        gate = Gate(relay)
        await kill_relay_connection(relay, r)
        # What a restart without persistence leaves of this fleet's keys: nothing.
        await r.delete(keys.epoch, keys.run("s-mid"), keys.output("s-mid"), keys.frames("s-mid"))
        gate.open.set()
        for sub in (started, queued):
            frame = await next_frame(sub)
            assert isinstance(frame, messages.Failed) and frame.code == "redis_state_lost" and sub.aborted
        await wait_connected(relay)
        sub = await relay.subscribe("after")  # and new requests are served
        assert await r.publish(keys.tokens("after"), delta("after", 0, "ok")) == 1
        assert (await next_frame(sub)).text == "ok"
    finally:
        await relay.close()


async def test_held_requests_fail_when_the_grace_is_over(redis_url, r, key_prefix):
    keys = Keys(key_prefix)
    relay = Relay(redis_url, keys, ping_interval_s=0.5, resume_s=0.3)
    await relay.start()
    try:
        sub = await relay.subscribe("waits")
        Gate(relay)  # never opened: Redis stays away
        await kill_relay_connection(relay, r)
        assert sub.get_nowait() is None  # held, not failed at once
        frame = await next_frame(sub, timeout=2)
        assert isinstance(frame, messages.Failed) and frame.code == "relay_disconnected" and "0.3 s" in frame.message
    finally:
        await relay.close()


def test_a_resumed_stream_delivers_logged_then_held_frames_in_order_once():
    sub = Subscription("x", b"ch", 16)
    sub.offer(messages.TokenDelta("x", 0, 0, [1], "a"))
    sub.hold()
    # Live frames that came while the log was being read: one of them is in the log too.
    sub.offer(messages.TokenDelta("x", 3, 3, [4], "d"))
    sub.offer(messages.TokenDelta("x", 2, 2, [3], "c"))
    assert sub.queue.qsize() == 1  # held back
    sub.resume([messages.TokenDelta("x", 1, 1, [2], "b"), messages.TokenDelta("x", 2, 2, [3], "c")])
    got = [sub.get_nowait() for _ in range(4)]
    assert [f.text for f in got] == ["a", "b", "c", "d"] and sub.get_nowait() is None and sub.duplicates == 1


@pytest.mark.parametrize("last_seq, kept, state, lost", [
    (-1, True, resume.Logged(False, 0, []), False),  # still queued: waits
    (-1, None, resume.Logged(False, 0, []), False),
    (-1, False, resume.Logged(False, 0, []), True),  # Redis lost everything: queued work too
    (4, True, resume.Logged(True, 7, [b"5", b"6"]), False),
    (4, True, resume.Logged(False, 0, []), True),  # output delivered, but no run state
    (4, True, resume.Logged(True, 3, []), True),  # fewer frames logged than delivered (AOF's last second)
    (4, None, resume.Logged(True, 5, []), False),
])
def test_what_a_reconnecting_relay_can_resume(last_seq, kept, state, lost):
    assert (resume.verdict(last_seq, kept, state) is not None) == lost
