"""The token relay against a real Redis: confirmed subscriptions, routing, duplicates, breakage."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from skyline.core import messages
from skyline.core.keys import Keys
from skyline.gateway.relay import Relay, RelayUnavailable


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


async def test_broken_connection_fails_in_flight_then_recovers(relay, r, key_prefix):
    keys = Keys(key_prefix)
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
