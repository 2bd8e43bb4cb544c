"""The Responses API's store in Redis, through the `openai` client: stored by default, retrieved and
continued on another gateway (both routes), background responses polled, streamed again, cancelled
from another gateway, deleted, their input items listed, owned by the key that made them, bounded
per tenant, expiring, and surviving a gateway's restart.

Two real gateways (uvicorn, in threads) share one real Redis; the test plays the workers by hand
(tests/test_gateway_flow.py's HandWorker), so it sees the prompt the fleet is given (a continued
conversation holds its history) and decides when output arrives (a background response is
cancelled while it runs). tests/test_responses_store_fleet.py runs the same calls on a sim fleet.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from skyline.core import messages
from skyline.core.config import KeyOptions
from skyline.core.keys import Keys
from skyline.gateway.response_store import ResponseStore
from skyline.gateway.responses_api import input_items, page
from skyline.gateway.testing import GatewayThread, announce_workers
from tests.procs import wait_until
from tests.test_gateway_flow import MAX_MODEL_LEN, MODEL, HandWorker, make_cfg

ROUTES = ("colocated", "disagg")


def take(worker: HandWorker, route: str) -> messages.GenerateRequest:
    """The request the gateway enqueued on `route` (colocated: the decode stage; disagg: prefill)."""
    _f, msg = worker.take("decode" if route == "colocated" else "prefill")
    return msg.request if isinstance(msg, messages.DecodeWork) else msg


def prompt_text(msg: messages.GenerateRequest) -> str:
    return bytes(t for t in msg.prompt_token_ids if t < 256).decode(errors="replace")


def client_for(gw: GatewayThread, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=15)


@pytest.fixture
def gateways(redis_url, key_prefix, request):
    """Two gateways on one Redis, a hand-played worker of each role, a thread pool."""
    options = getattr(request, "param", {})
    cfg = make_cfg(redis_url, key_prefix, **options)
    announce_workers(redis_url, Keys(key_prefix), "prefill", "decode", model=MODEL)
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as a, GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as b:
        with ThreadPoolExecutor(4) as pool:
            yield a, b, HandWorker(redis_url, Keys(key_prefix)), pool


@pytest.mark.parametrize("route", ROUTES)
def test_a_stored_response_is_retrieved_and_continued_on_another_gateway(gateways, route):
    a, b, worker, pool = gateways
    first, second = client_for(a), client_for(b)
    headers = {"x-skyline-route": route}
    fut = pool.submit(first.responses.create, model=MODEL, input="Capital of France?", extra_headers=headers)
    msg = take(worker, route)
    first_prompt = msg.prompt_token_ids
    assert msg.route == route and "Capital of France?" in prompt_text(msg)
    worker.send(*worker.script(msg.request_id, ["Par", "is"]))
    resp = fut.result()  # `store` left out: the API's default, true
    assert resp.status == "completed" and resp.output_text == "Paris" and msg.request_id.startswith(resp.id)

    got = second.responses.retrieve(resp.id)  # another gateway, at once
    assert got.id == resp.id and got.output_text == "Paris" and got.status == "completed"

    fut = pool.submit(second.responses.create, model=MODEL, input="And of Italy?", previous_response_id=resp.id,
                      extra_headers=headers)
    msg = take(worker, route)
    text = prompt_text(msg)  # the history: the first question, its answer, then the new one
    assert text.index("Capital of France?") < text.index("Paris") < text.index("And of Italy?"), text
    assert msg.prompt_token_ids[:len(first_prompt)] == first_prompt  # what a prefix cache holds already
    worker.send(*worker.script(msg.request_id, ["Rome"]))
    turn2 = fut.result()
    assert turn2.output_text == "Rome" and turn2.previous_response_id == resp.id

    items = first.responses.input_items.list(turn2.id)  # this response's own input, newest first
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "And of Italy?")]

    # And a third turn on the first gateway continues the whole chain.
    fut = pool.submit(first.responses.create, model=MODEL, input="And Spain?", previous_response_id=turn2.id,
                      extra_headers=headers)
    msg = take(worker, route)
    text = prompt_text(msg)
    assert text.index("France") < text.index("Paris") < text.index("Italy") < text.index("Rome") < text.index("Spain")
    worker.send(*worker.script(msg.request_id, ["Madrid"]))
    assert fut.result().output_text == "Madrid"


def test_store_false_keeps_nothing_and_an_unknown_previous_id_is_404(gateways, redis_url, key_prefix):
    a, _b, worker, pool = gateways
    client = client_for(a)
    fut = pool.submit(client.responses.create, model=MODEL, input="q", store=False)
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["x"]))
    resp = fut.result()
    with pytest.raises(openai.NotFoundError, match=resp.id):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.create(model=MODEL, input="q", previous_response_id="resp_nope")
    assert not redis.Redis.from_url(redis_url).exists(Keys(key_prefix).response(resp.id))
    with pytest.raises(openai.BadRequestError, match="conversation"):  # no Conversations API: refused, not ignored
        client.responses.create(model=MODEL, input="q", extra_body={"conversation": "conv_1"})


def test_a_streamed_response_is_stored_before_its_last_event(gateways):
    a, b, worker, pool = gateways

    def run() -> list:
        events = []
        for event in client_for(a).responses.create(model=MODEL, input="stream", stream=True):
            if event.type == "response.completed":  # stored already: another gateway has it
                events.append(client_for(b).responses.retrieve(event.response.id))
            events.append(event)
        return events

    fut = pool.submit(run)
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["ab", "cd"]))
    events = fut.result()
    stored, completed = events[-2], events[-1]
    assert completed.type == "response.completed" and completed.response.output_text == "abcd"
    assert stored.output_text == "abcd" and stored.id == completed.response.id


def test_a_background_response_is_polled_to_completion_on_any_gateway(gateways):
    a, b, worker, _pool = gateways
    queued = client_for(a).responses.create(model=MODEL, input="slow question", background=True)
    assert queued.status == "queued" and queued.background is True  # at once, before any output
    poll = client_for(b)
    assert poll.responses.retrieve(queued.id).status == "queued"
    msg = take(worker, "disagg")
    assert msg.request_id.startswith(queued.id)
    worker.send(messages.TokenDelta(msg.request_id, 0, 0, [65], "A"))
    wait_until(lambda: poll.responses.retrieve(queued.id).status == "in_progress", 10, "in_progress at the first token")
    worker.send(messages.TokenDelta(msg.request_id, 1, 1, [66], "B"),
                messages.Finished(msg.request_id, 2, "stop", 3, 2))
    done = wait_until(lambda: (r := poll.responses.retrieve(queued.id)).status == "completed" and r, 10,
                      "the background response completed")
    assert done.output_text == "AB" and done.usage.output_tokens == 2
    with pytest.raises(openai.BadRequestError, match="completed"):
        poll.responses.cancel(queued.id)


def test_a_background_response_is_cancelled_from_another_gateway(gateways, redis_url, key_prefix):
    a, b, worker, _pool = gateways
    queued = client_for(a).responses.create(model=MODEL, input="long job", background=True)
    msg = take(worker, "disagg")
    worker.send(messages.TokenDelta(msg.request_id, 0, 0, [65], "A"))
    cancelled = client_for(b).responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    # The gateway running it (a) stops it in the fleet: the request's tombstone is there for workers.
    r = redis.Redis.from_url(redis_url)
    wait_until(lambda: r.exists(Keys(key_prefix).cancelled(msg.request_id)), 10, "the fleet request cancelled")
    assert client_for(a).responses.retrieve(queued.id).status == "cancelled"
    assert client_for(b).responses.retrieve(queued.id).status == "cancelled"


def test_a_background_stream_is_resumed_after_an_event_on_another_gateway(gateways):
    a, b, worker, pool = gateways
    fut = pool.submit(lambda: list(client_for(a).responses.create(model=MODEL, input="s", background=True,
                                                                  stream=True)))
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["one ", "two ", "three"]), gap_s=0.05)
    events = fut.result()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "one two three"
    rid = events[-1].response.id
    with httpx.stream("GET", f"{b.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 2},
                      timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        again = [json.loads(line[len("data: "):]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in again] == list(range(3, len(events)))
    assert again[-1]["type"] == "response.completed"
    assert again[-1]["response"]["output"][0]["content"][0]["text"] == "one two three"
    # A response that was not a background stream has no events to send again.
    done = client_for(a).responses.create(model=MODEL, input="q", background=True)
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["x"]))
    wait_until(lambda: client_for(a).responses.retrieve(done.id).status == "completed", 10, "completed")
    resp = httpx.get(f"{a.url}/v1/responses/{done.id}", params={"stream": "true"}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream", resp.text


def test_delete_and_input_items(gateways):
    a, b, worker, pool = gateways
    items = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "two"}]}]
    fut = pool.submit(client_for(a).responses.create, model=MODEL, input=items)
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["ok"]))
    resp = fut.result()
    listed = client_for(b).responses.input_items.list(resp.id, order="asc")
    assert [i.content[0].text for i in listed.data] == ["Be brief.", "one", "two"]
    assert all(i.id for i in listed.data) and not listed.has_more
    first = client_for(b).responses.input_items.list(resp.id, limit=2)  # newest first
    assert [i.content[0].text for i in first.data] == ["two", "one"] and first.has_more
    rest = client_for(b).responses.input_items.list(resp.id, limit=2, after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["Be brief."] and not rest.has_more
    for read in (client_for(b).responses.retrieve, client_for(b).responses.input_items.list):
        with pytest.raises(openai.BadRequestError, match="include"):  # not kept by the store: refused, not ignored
            read(resp.id, include=["message.output_text.logprobs"])

    client_for(b).responses.delete(resp.id)
    for client in (client_for(a), client_for(b)):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client_for(a).responses.delete(resp.id)


@pytest.mark.parametrize("gateways", [{"api_keys": ("key-a", "key-b"), "operator_api_keys": ("op",)}],
                         indirect=True)
def test_a_stored_response_belongs_to_the_key_that_made_it(gateways):
    a, b, worker, pool = gateways
    fut = pool.submit(client_for(a, "key-a").responses.create, model=MODEL, input="mine")
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["yes"]))
    resp = fut.result()
    assert client_for(b, "key-a").responses.retrieve(resp.id).output_text == "yes"
    other = client_for(b, "key-b")
    for call in (lambda: other.responses.retrieve(resp.id), lambda: other.responses.delete(resp.id),
                 lambda: other.responses.cancel(resp.id), lambda: other.responses.input_items.list(resp.id),
                 lambda: other.responses.create(model=MODEL, input="x", previous_response_id=resp.id)):
        with pytest.raises(openai.NotFoundError, match=f"Response with id '{resp.id}' not found"):
            call()
    assert client_for(a, "op").responses.retrieve(resp.id).id == resp.id  # operators see every tenant's


@pytest.mark.parametrize("gateways", [{"api_keys": ("key-a", "key-b", "key-c"), "response_store_max_bytes": 6000,
                                       "key_options": (KeyOptions("key-c", "keys.txt line 3", response_store_bytes=100),)}],
                         indirect=True)
def test_each_tenant_stores_at_most_its_bound(gateways, redis_url, key_prefix):
    a, _b, worker, pool = gateways
    client = client_for(a, "key-a")
    stored = []
    with pytest.raises(openai.RateLimitError, match="response_store_max_bytes") as refused:
        for _ in range(20):
            fut = pool.submit(client.responses.create, model=MODEL, input="fill " * 20)
            msg = take(worker, "disagg")
            worker.send(*worker.script(msg.request_id, ["x" * 50]))
            stored.append(fut.result().id)
    assert refused.value.code == "response_store_full" and 1 <= len(stored) < 20
    r = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    owners = [k for k in r.scan_iter(f"{key_prefix}:responses:*:bytes")]
    assert len(owners) == 1 and int(r.hget(owners[0], "total")) <= 6000
    # Another tenant has its own allowance; a deleted response frees its bytes.
    fut = pool.submit(client_for(a, "key-b").responses.create, model=MODEL, input="mine")
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["ok"]))
    assert fut.result().status == "completed"
    # A key whose line of the key file gives it its own bound.
    fut = pool.submit(client_for(a, "key-c").responses.create, model=MODEL, input="mine")
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["ok"]))
    with pytest.raises(openai.RateLimitError, match="of the 100 it may keep"):
        fut.result()
    client.responses.delete(stored[0])
    fut = pool.submit(client.responses.create, model=MODEL, input="again")
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["ok"]))
    assert client.responses.retrieve(fut.result().id).output_text == "ok"
    assert r.ttl(keys.response(stored[1])) > 0


@pytest.mark.parametrize("gateways", [{"response_store_ttl_s": 400}], indirect=True)
def test_a_stored_response_expires_after_the_configured_time(gateways, redis_url, key_prefix):
    a, _b, worker, pool = gateways
    fut = pool.submit(client_for(a).responses.create, model=MODEL, input="q")
    msg = take(worker, "disagg")
    worker.send(*worker.script(msg.request_id, ["x"]))
    rid = fut.result().id
    r = redis.Redis.from_url(redis_url)
    assert 390 <= r.ttl(Keys(key_prefix).response(rid)) <= 400
    r.expire(Keys(key_prefix).response(rid), 1)  # as if 400 s went by
    wait_until(lambda: not r.exists(Keys(key_prefix).response(rid)), 5, "the record expired")
    with pytest.raises(openai.NotFoundError):
        client_for(a).responses.retrieve(rid)


def test_stored_responses_survive_a_gateway_restart_and_a_dead_gateways_background_fails(
        redis_url, key_prefix):
    cfg = make_cfg(redis_url, key_prefix)
    keys = Keys(key_prefix)
    announce_workers(redis_url, keys, "prefill", "decode", model=MODEL)
    worker = HandWorker(redis_url, keys)
    with ThreadPoolExecutor(2) as pool:
        with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:
            fut = pool.submit(client_for(gw).responses.create, model=MODEL, input="q")
            msg = take(worker, "disagg")
            worker.send(*worker.script(msg.request_id, ["kept"]))
            kept = fut.result().id
            running = client_for(gw).responses.create(model=MODEL, input="never ends", background=True).id
            take(worker, "disagg")
        with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:  # the gateway came back
            client = client_for(gw)
            assert client.responses.retrieve(kept).output_text == "kept"
            # Its background response could not go on: stopped gateways close theirs as failed.
            late = client.responses.retrieve(running)
            assert late.status == "failed" and "stopped" in late.error.message
            # One whose gateway died without a word (its lease lapsed) fails at the next read.
            asyncio.run(_orphan(redis_url, keys, "resp_orphan"))
            lost = client.responses.retrieve("resp_orphan")
            assert lost.status == "failed" and "stopped" in lost.error.message
            # A reader of a background stream whose gateway dies while it reads: the stream ends with an error.
            asyncio.run(_orphan(redis_url, keys, "resp_orphan_stream", stream=True,
                                lease_ms=int(time.time() * 1000) + 1500))
            with httpx.stream("GET", f"{gw.url}/v1/responses/resp_orphan_stream", params={"stream": "true"},
                              timeout=15) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
            assert [e["type"] for e in events] == ["response.created", "error"] and "stopped" in events[-1]["message"]
            assert client.responses.retrieve("resp_orphan_stream").status == "failed"


async def _orphan(redis_url: str, keys: Keys, rid: str, stream: bool = False, lease_ms: int = 1) -> None:
    """A background response whose gateway is gone: its record, with a lease that ends at `lease_ms`."""
    r = aioredis.from_url(redis_url)
    try:
        body = {"id": rid, "object": "response", "status": "queued", "output": [], "created_at": 1, "model": MODEL,
                "background": True, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
        st = ResponseStore(r, keys, 600, 0)
        await st.create(rid, "", "queued", body, [], [], background=True, stream=stream)
        if stream:
            await st.append_events(rid, [json.dumps({"type": "response.created", "sequence_number": 0,
                                                     "response": body})])
        await r.hset(keys.response(rid), "lease_ms", lease_ms)
    finally:
        await r.aclose()


def test_input_items_and_pages_are_the_apis_shapes():
    items = input_items("hi")
    assert items[0]["type"] == "message" and items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[0]["id"].startswith("msg_") and items[0]["role"] == "user"
    call = input_items([{"type": "function_call_output", "call_id": "c", "output": "42"},
                        {"role": "assistant", "content": "sure"}])
    assert call[0]["id"].startswith("item_") and call[1]["content"] == [{"type": "output_text", "text": "sure"}]
    listed = [{"id": str(i)} for i in range(5)]
    assert [d["id"] for d in page(listed, None, None, 2, "desc")["data"]] == ["4", "3"]
    assert page(listed, "3", None, 2, "desc")["data"] == [{"id": "2"}, {"id": "1"}]
    assert page(listed, None, "2", 10, "asc") == {"object": "list", "data": [{"id": "0"}, {"id": "1"}],
                                                  "first_id": "0", "last_id": "1", "has_more": False}
