"""The batch store against a real Redis: results recorded once, guarded status transitions, finalisation."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from skyline.batch import jsonl
from skyline.batch.store import BatchStore
from skyline.core.keys import Keys


def run(coro):
    return asyncio.run(coro)


async def _store(redis_url: str, prefix: str) -> BatchStore:
    return BatchStore(aioredis.from_url(redis_url), Keys(prefix), file_ttl_s=60)


def _batch(bid: str, created: int) -> dict:
    return {"id": bid, "endpoint": "/v1/completions", "input_file_id": "file-x", "completion_window": "24h",
            "status": "in_progress", "created_at": created, "expires_at": created + 86_400, "total": 3,
            "completed": 0, "failed": 0}


def test_a_line_is_recorded_once_and_counted_once(redis_url, key_prefix):
    async def go():
        st = await _store(redis_url, key_prefix)
        await st.create_batch(_batch("batch_a", 1))
        first = jsonl.response_line("c1", 200, "cmpl-1", {"usage": {"prompt_tokens": 3, "completion_tokens": 4}})
        again = jsonl.response_line("c1", 200, "cmpl-2", {})
        assert await st.record("batch_a", 1, first) is True
        assert await st.record("batch_a", 1, again) is False  # a second answer for the line is dropped
        assert (await st.result("batch_a", 1))["response"]["request_id"] == "cmpl-1"
        assert (await st.batch("batch_a"))["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
        assert await st.claim("batch_a", 2, 10, "gw-1") and not await st.claim("batch_a", 2, 10, "gw-2")
        await st.release("batch_a", 2)
        assert await st.claim("batch_a", 2, 10, "gw-2")
        await st.r.aclose()

    run(go())


def test_transitions_only_leave_the_states_they_name(redis_url, key_prefix):
    async def go():
        st = await _store(redis_url, key_prefix)
        await st.create_batch(_batch("batch_t", 1))
        assert await st.transition("batch_t", ("validating",), "in_progress") == (False, "in_progress")
        assert await st.transition("batch_t", ("validating", "in_progress"), "cancelling", cancelling_at=5) == \
            (True, "in_progress")
        assert (await st.batch("batch_t"))["cancelling_at"] == 5
        assert await st.transition("nope", ("in_progress",), "failed") == (False, "")
        await st.r.aclose()

    run(go())


def test_finalize_fills_lines_that_never_ran_and_writes_both_files_in_input_order(redis_url, key_prefix):
    async def go():
        st = await _store(redis_url, key_prefix)
        await st.create_batch(_batch("batch_f", 1))
        await st.record("batch_f", 3, jsonl.response_line("c3", 200, "cmpl-3", {"usage": {"prompt_tokens": 2,
                                                                                         "completion_tokens": 5}}))
        await st.record("batch_f", 1, jsonl.response_line("c1", 400, "cmpl-1", {"error": {"message": "no"}}))
        await st.transition("batch_f", ("in_progress",), "cancelling")
        obj = await st.finalize("batch_f", {1: "c1", 2: "c2", 3: "c3"}, "cancelled", "batch_cancelled", "cancelled")
        assert obj["status"] == "cancelled" and obj["cancelled_at"]
        assert obj["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
        assert obj["usage"]["output_tokens"] == 5
        out = (await st.file_content(obj["output_file_id"])).decode().splitlines()
        err = (await st.file_content(obj["error_file_id"])).decode().splitlines()
        assert [json.loads(x)["custom_id"] for x in out] == ["c3"]
        assert [json.loads(x)["custom_id"] for x in err] == ["c1", "c2"]
        assert json.loads(err[1])["error"]["code"] == "batch_cancelled"
        assert (await st.file(obj["error_file_id"]))["purpose"] == "batch_output"
        again = await st.finalize("batch_f", {1: "c1", 2: "c2", 3: "c3"}, "cancelled", "batch_cancelled", "x")
        assert again["error_file_id"] == obj["error_file_id"]  # a retried finalisation writes the same files
        await st.r.aclose()

    run(go())


def test_batches_are_listed_newest_first_with_paging(redis_url, key_prefix):
    async def go():
        st = await _store(redis_url, key_prefix)
        for i in range(5):
            await st.create_batch(_batch(f"batch_{i}", 100 + i))
        page, more = await st.list_batches(None, 2)
        assert [b["id"] for b in page] == ["batch_4", "batch_3"] and more
        page, more = await st.list_batches("batch_3", 10)
        assert [b["id"] for b in page] == ["batch_2", "batch_1", "batch_0"] and not more
        await st.r.delete(Keys(key_prefix).batch("batch_1"))  # expired
        page, _ = await st.list_batches("batch_3", 10)
        assert [b["id"] for b in page] == ["batch_2", "batch_0"]
        await st.r.aclose()

    run(go())


def test_owners_lists_hold_only_their_own_and_the_batch_files_are_the_batch_owners(redis_url, key_prefix):
    async def go():
        st = await _store(redis_url, key_prefix)
        for i in range(4):  # alternating owners; "" (a gateway without keys) is listed only with everything
            await st.create_batch({**_batch(f"batch_o{i}", 200 + i), "owner": ("alice", "bob")[i % 2]})
        await st.create_batch(_batch("batch_anon", 300))
        assert [b["id"] for b in (await st.list_batches(None, 10, "alice"))[0]] == ["batch_o2", "batch_o0"]
        page, more = await st.list_batches(None, 1, "bob")
        assert [b["id"] for b in page] == ["batch_o3"] and more
        assert [b["id"] for b in (await st.list_batches("batch_o3", 10, "bob"))[0]] == ["batch_o1"]
        everyone, _ = await st.list_batches(None, 10)
        assert [b["id"] for b in everyone] == ["batch_anon", "batch_o3", "batch_o2", "batch_o1", "batch_o0"]
        assert "owner" not in everyone[1]  # the digest stays in Redis: it is no field of the OpenAI object

        await st.record("batch_o0", 1, jsonl.response_line("c1", 200, "cmpl-1", {}))
        await st.record("batch_o0", 2, jsonl.response_line("c2", 400, "cmpl-2", {"error": {"message": "no"}}))
        done = await st.finalize("batch_o0", {1: "c1", 2: "c2"}, "completed", "missing_result", "none")
        for fid in (done["output_file_id"], done["error_file_id"]):
            assert (await st.file_fields(fid))["owner"] == "alice"
        alices, _ = await st.list_files(None, 10, "alice")
        assert {f["id"] for f in alices} == {done["output_file_id"], done["error_file_id"]}
        assert (await st.list_files(None, 10, "bob")) == ([], False)
        await st.r.aclose()

    run(go())


def test_files_are_listed_by_purpose_in_either_order_and_expired_ones_drop_out(redis_url, key_prefix):
    async def go():
        st = await _store(redis_url, key_prefix)
        ids = []
        for i in range(5):
            f = await st.put_file(b"{}\n", f"f{i}.jsonl", "batch" if i != 2 else "batch_output", owner="alice")
            ids.append(f["id"])
            await st.r.zadd(Keys(key_prefix).files_of("alice"), {f["id"]: 100 + i})  # distinct creation seconds
        newest, more = await st.list_files(None, 2, "alice", "batch")
        assert [f["id"] for f in newest] == [ids[4], ids[3]] and more
        rest, more = await st.list_files(ids[3], 10, "alice", "batch")
        assert [f["id"] for f in rest] == [ids[1], ids[0]] and not more  # ids[2] is another purpose
        await st.r.delete(Keys(key_prefix).file(ids[0]))  # expired
        oldest, _ = await st.list_files(None, 10, "alice", newest_first=False)
        assert [f["id"] for f in oldest] == ids[1:]
        assert ids[0].encode() not in await st.r.zrange(Keys(key_prefix).files_of("alice"), 0, -1)
        await st.r.aclose()

    run(go())


def test_the_lists_expire_once_every_member_has(redis_url, key_prefix):
    """A tenant that stops using the API leaves no list behind: each list's TTL is renewed with every
    member and outlasts the longest-lived one (a file's TTL; a batch's window plus that)."""
    async def go():
        st = await _store(redis_url, key_prefix)
        await st.put_file(b"{}\n", "in.jsonl", "batch", owner="tenant-a")
        await st.create_batch({**_batch("batch_e", 1), "owner": "tenant-a"})
        keys = st.keys
        for zset in (keys.files, keys.files_of("tenant-a")):
            assert 55 <= await st.r.ttl(zset) <= 60
        for zset in (keys.batches, keys.batches_of("tenant-a")):
            assert 86_400 < await st.r.ttl(zset) <= 86_460
        forever = BatchStore(st.r, Keys(key_prefix + "-forever"), file_ttl_s=0)  # files kept until deleted
        await forever.put_file(b"{}\n", "in.jsonl", "batch", owner="tenant-b")
        assert await st.r.ttl(forever.keys.files_of("tenant-b")) == -1
        await st.r.aclose()

    run(go())
