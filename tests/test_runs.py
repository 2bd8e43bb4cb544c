"""The delivery-state scripts (workers/runs.py) against a real Redis: hand-off once,
claims fence earlier owners, frames applied once and logged for migration and for a
relay that catches up, a frame after lost ones refused."""

from __future__ import annotations

import redis.asyncio as aioredis

from skyline.core.keys import Keys
from skyline.workers.runs import FENCED, STATE_LOST, Runs


async def test_hand_off_happens_once(redis_url, key_prefix):
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    runs = Runs(r, keys, ttl_s=60)
    stream = keys.stream("decode", "standard")
    first = await runs.hand_off("req-1", stream, {"id": "req-1", "msg": b"x"}, "prefill-a", 1000)
    again = await runs.hand_off("req-1", stream, {"id": "req-1", "msg": b"y"}, "prefill-b", 1000)
    assert first and again is None
    assert await r.xlen(stream) == 1 and await r.hget(keys.run("req-1"), "handoff") == b"prefill-a"
    await r.aclose()


async def test_claims_fence_earlier_owners_and_frames_apply_once(redis_url, key_prefix):
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    runs = Runs(r, keys, ttl_s=60)
    channel = keys.tokens("req-2")

    async def publish(attempt: int, frame: int, tokens: list[int], final: bool = False) -> int:
        k, a = runs.publish_args("req-2", attempt, channel, b"frame-%d" % frame, final, tokens, frame)
        return await runs.publish_script(keys=k, args=a)

    first = await runs.claim("req-2", "decode-a")
    assert (first.attempt, first.frames, first.output, first.done) == (1, 0, [], False)
    assert await publish(1, 0, [10, 11]) == 0  # nobody subscribed, but applied
    assert await publish(1, 0, [10, 11]) == 1  # the same frame again (a retried call): not applied twice
    assert await publish(1, 1, [12]) == 0

    second = await runs.claim("req-2", "decode-b")  # a takeover
    assert (second.attempt, second.frames, second.output) == (2, 2, [10, 11, 12])
    assert second.resumed
    assert await publish(1, 2, [99]) == FENCED  # the old owner can no longer publish
    assert await publish(2, 2, [13], final=True) == 0
    third = await runs.claim("req-2", "decode-c")
    assert third.done and third.output == []  # final frame sent: nothing to resume, only the ack is left
    # Every frame applied is in the frame log, once, in order; kept only a short while after the end.
    assert await r.lrange(keys.frames("req-2"), 0, -1) == [b"frame-0", b"frame-1", b"frame-2"]
    assert 0 < await r.ttl(keys.frames("req-2")) <= runs.kept_after_final_s
    await r.aclose()


async def test_a_frame_after_frames_redis_lost_is_refused(redis_url, key_prefix):
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    runs = Runs(r, keys, ttl_s=60)
    await runs.claim("req-3", "decode-a")

    async def publish(frame: int) -> int:
        k, a = runs.publish_args("req-3", 1, keys.tokens("req-3"), b"f", False, [frame], frame)
        return await runs.publish_script(keys=k, args=a)

    assert await publish(0) == 0
    # Frames 1 and 2 were published, then lost (a crash took AOF's last second with it).
    assert await publish(3) == STATE_LOST
    assert await r.llen(keys.frames("req-3")) == 1 and await r.hget(keys.run("req-3"), "frames") == b"1"
    await r.aclose()
