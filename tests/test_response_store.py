"""The Responses API's store against a real Redis: one outcome when a cancel races the end of a
background response, each owner's bytes bound (expired responses give their bytes back, a response
that would pass the bound is stored as failed), ids that cannot be taken twice."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from skyline.core.keys import Keys
from skyline.gateway.response_store import IdTaken, ResponseStore, StoreFull


def _body(rid: str, status: str = "queued", text: str = "") -> dict:
    output = [{"type": "message", "content": [{"type": "output_text", "text": text}]}] if text else []
    return {"id": rid, "object": "response", "status": status, "output": output, "created_at": 1}


def _run(redis_url: str, prefix: str, max_bytes: int, test) -> None:
    async def go() -> None:
        r = aioredis.from_url(redis_url)
        try:
            await test(ResponseStore(r, Keys(prefix), 600, max_bytes), r, Keys(prefix))
        finally:
            await r.aclose()

    asyncio.run(go())


def test_a_cancel_racing_the_end_settles_on_one_outcome(redis_url, key_prefix):
    async def test(st: ResponseStore, _r, _keys) -> None:
        await st.create("resp_a", "o", "queued", _body("resp_a"), [], [], background=True)
        rec = await st.get("resp_a")
        assert await st.mark(rec, "cancelled", _body("resp_a", "cancelled"))
        # The gateway running it finishes after the cancel: the cancel stands.
        assert not await st.finish(rec, "completed", _body("resp_a", "completed", "late"), [])
        got = await st.get("resp_a")
        assert got.status == "cancelled" and got.response["status"] == "cancelled" and not got.active
        assert await st.renew("resp_a") == "cancelled"
        assert await st.renew("resp_gone") is None  # a deleted one: no stray record made
        assert await st.get("resp_gone") is None

    _run(redis_url, key_prefix, 0, test)


def test_each_owner_is_bounded_and_expired_responses_give_their_bytes_back(redis_url, key_prefix):
    async def test(st: ResponseStore, r, keys: Keys) -> None:
        await st.create("resp_1", "alice", "completed", _body("resp_1", "completed", "x" * 300), [], [])
        used = await st.usage("alice")
        assert 300 < used < 1000
        with pytest.raises(StoreFull):
            await st.create("resp_2", "alice", "completed", _body("resp_2", "completed", "y" * 600), [], [])
        await st.create("resp_3", "bob", "completed", _body("resp_3", "completed", "y" * 600), [], [])  # his own
        assert await st.usage("bob") > 600 and await st.usage("alice") == used
        # resp_1's time is up: the next write drops it from alice's account.
        await r.zadd(keys.responses_of("alice"), {"resp_1": 1})
        await r.delete(keys.response("resp_1"))
        assert await st.usage("alice") == 0
        await st.create("resp_2", "alice", "completed", _body("resp_2", "completed", "y" * 600), [], [])

    _run(redis_url, key_prefix, 1000, test)


def test_a_background_response_past_the_bound_ends_failed(redis_url, key_prefix):
    async def test(st: ResponseStore, _r, _keys) -> None:
        await st.create("resp_b", "o", "queued", _body("resp_b"), [], [], background=True)
        rec = await st.get("resp_b")
        assert await st.finish(rec, "completed", _body("resp_b", "completed", "z" * 2000), [])
        got = await st.get("resp_b")
        assert got.status == "failed" and "not stored" in got.response["error"]["message"]
        assert got.response["output"] == [] and await st.usage("o") < 1000

    _run(redis_url, key_prefix, 1000, test)


def test_an_id_is_stored_once_whoever_asks(redis_url, key_prefix):
    async def test(st: ResponseStore, _r, _keys) -> None:
        await st.create("resp_c", "alice", "completed", _body("resp_c", "completed"), [], [])
        for owner in ("alice", "mallory"):
            with pytest.raises(IdTaken):
                await st.create("resp_c", owner, "completed", _body("resp_c", "completed", "mine"), [], [])
        assert (await st.get("resp_c")).owner == "alice" and await st.usage("mallory") == 0
        await st.delete(await st.get("resp_c"))
        assert await st.get("resp_c") is None and await st.usage("alice") == 0

    _run(redis_url, key_prefix, 0, test)
