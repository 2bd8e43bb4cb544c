"""The Responses API with its store in Redis: create, retrieve, cancel, delete, input items.

  POST   /v1/responses                       vLLM's own Responses serving (store, background, previous_response_id)
  GET    /v1/responses/{id}                  a stored response (`?stream=true&starting_after=N`: a background
                                             stream's events again, from event N+1)
  POST   /v1/responses/{id}/cancel           cancel a background response
  DELETE /v1/responses/{id}                  delete a stored response
  GET    /v1/responses/{id}/input_items      its input items, paged as the OpenAI API pages them

Skyline writes no second Responses implementation: vLLM's `OpenAIServingResponses` renders,
generates (over the fleet), parses, runs background requests in tasks and keeps its store in
dicts of its own (gateway/vllm_serving_internals.py turns that store on). This module makes those
dicts a per-request staging area of a store in Redis (gateway/response_store.py):
- `previous_response_id`: the stored response and its conversation are read from Redis and put
  where vLLM looks for them for the one request that continues it, then removed;
- a request that ends (or a background one that starts) has what vLLM stored moved to Redis
  before the client is answered, so any gateway finds it at once;
- a background response runs in vLLM's task on the gateway that took it, with a follower here
  that renews its lease, marks it in_progress once the fleet sends its first output, copies its events to Redis
  (a background stream) and writes its end; a cancel made on another gateway reaches it through
  the record's status, which the follower reads with each renewal.
Every route answers only about the key's own responses (operator keys: everyone's;
gateway/tenants.py): another tenant's id is a 404 with the message of a missing one.

Several models through one gateway (gateway/models.py): a request is served by vLLM's Responses
serving object of the model it names (`create(serving, ...)`), which renders it with that model's
chat template and queues it for that model's workers; the stored response keeps its `model`, as vLLM
wrote it. A conversation may go on with another model (`previous_response_id` of a response of
model A in a request for model B): its stored messages are rendered by B, as the OpenAI API allows.
A background response is cancelled in the serving object that runs it (`running`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.gateway import vllm_serving_internals as vllm
from skyline.gateway.errors import ApiError
from skyline.gateway.fleet_client import SCOPE, RequestScope
from skyline.gateway.openai_api import Frontend
from skyline.gateway.ratelimit import KeyRateLimiter
from skyline.gateway.response_store import ACTIVE, IdTaken, ResponseStore, StoredResponse, StoreFull, with_error
from skyline.gateway.tenants import ANONYMOUS, Tenant, Tenants, api_key_of, tenant_of

log = logging.getLogger("skyline.gateway")

RENEW_S = 1.0  # a background response's follower renews its lease, and reads its status, this often
POLL_S = 0.05  # a stream's events are copied to Redis, and read back by a reader, this often
TERMINAL_EVENTS = ("response.completed", "response.failed", "response.incomplete", "error")
MAX_INPUT_ITEMS_PAGE = 100


class ResponsesApi:
    """The Responses routes of one gateway; `redis_of()` gives the app's Redis client (None before start-up)."""

    def __init__(self, cfg: SkylineConfig, tenants: Tenants, rate_limiter: KeyRateLimiter,
                 redis_of: Callable[[], aioredis.Redis | None]):
        g = cfg.gateway
        self.enabled = g.response_store_ttl_s > 0
        self.ttl_s, self.max_bytes = g.response_store_ttl_s, g.response_store_max_bytes
        self.tenants = tenants
        self.rate_limiter = rate_limiter
        self.redis_of = redis_of
        self.keys = Keys(cfg.key_prefix)
        self._store: ResponseStore | None = None
        # (serving object, previous response) put in vLLM's memory -> requests using it
        self._staged: dict[tuple[int, str], int] = {}
        self.followers: dict[str, asyncio.Task] = {}  # background responses this gateway runs
        self.running: dict[str, Any] = {}  # ... and the serving object (the model's) each runs in
        self.closing = False

    def store(self) -> ResponseStore:
        r = self.redis_of()
        if r is None:
            raise ApiError(503, "the gateway is not connected to Redis yet", code="redis_unavailable")
        if self._store is None or self._store.r is not r:
            self._store = ResponseStore(r, self.keys, self.ttl_s, self.max_bytes)
        return self._store

    # ---- POST /v1/responses (vLLM's create, through the generation route) ----------------------

    def for_model(self, front: Frontend) -> Callable[[Any, Request], Any]:
        """The create call of the model whose serving objects are `front` (what its route awaits)."""
        if self.enabled and not front.responses.enable_store:  # vLLM's store on, once per model's objects
            vllm.enable_response_store(front.responses)
        return lambda req, raw: self.create(front.responses, req, raw)

    async def create(self, serving: Any, req: Any, raw: Request) -> Any:
        tenant = tenant_of(raw) or ANONYMOUS
        if (req.model_extra or {}).get("conversation") is not None:
            # vLLM's request model lets unknown fields through: without this, the turn would be answered
            # without the conversation's items and never added to it.
            raise ApiError(400, "`conversation` is not supported: there is no Conversations API here; continue "
                                "with `previous_response_id`, or send the whole conversation in `input`",
                           param="conversation")
        if not self.enabled:
            return await self._without_store(serving, req, raw)
        if req.background and not req.store:
            raise ApiError(400, "`background: true` needs `store: true` (a background response is read back "
                                "from the store)", param="background")
        prev = None
        if req.previous_response_id is not None:
            prev = await self._owned(req.previous_response_id, tenant, param="previous_response_id")
        if req.store:
            try:
                await _redis(self.store().check_room(tenant.owner, self.bound(tenant)))
            except StoreFull as exc:
                raise self._full(exc) from None
        staged = prev is not None and self._stage(serving, prev)
        background_scope, token = None, None
        if req.background:
            # vLLM runs it in a task that outlives this HTTP request: its fleet request must not
            # watch this connection, nor be closed with it (fleet_client.RequestScope.detached).
            background_scope = _detached(SCOPE.get())
            token = SCOPE.set(background_scope)
        try:
            result = await serving.create_responses(req, raw)
        except BaseException:
            vllm.drop_stored(serving, req.request_id)
            raise
        finally:
            if token is not None:
                SCOPE.reset(token)
            if staged:
                self._unstage(serving, req.previous_response_id)
        if vllm.is_error_response(result):
            vllm.drop_stored(serving, req.request_id)
            return result
        if req.background:
            assert background_scope is not None
            return await self._start_background(serving, req, result, background_scope, tenant)
        if hasattr(result, "__anext__"):
            return self._stream(serving, req, result, tenant)
        try:
            if req.store:
                await self._keep(serving, req, tenant)
        finally:
            vllm.drop_stored(serving, req.request_id)
        return result

    async def _without_store(self, serving: Any, req: Any, raw: Request) -> Any:
        """`[gateway] response_store_ttl_s = 0`: `vllm serve` without its store (`store` ignored)."""
        why = "needs the response store, which is off on this gateway ([gateway] response_store_ttl_s = 0)"
        if req.background:
            raise ApiError(400, f"`background: true` {why}", param="background")
        if req.previous_response_id is not None:
            raise ApiError(400, f"`previous_response_id` {why}; send the whole conversation in `input`",
                           param="previous_response_id")
        result = await serving.create_responses(req, raw)
        return self._stream(serving, req, result, None) if hasattr(result, "__anext__") else result

    async def _keep(self, serving: Any, req: Any, tenant: Tenant) -> None:
        """Move what vLLM stored for a finished request to Redis (before the client hears of it)."""
        response, messages = vllm.take_stored(serving, req.request_id)
        if response is None:
            return
        body = vllm.response_json(response)
        try:
            await _redis(self.store().create(req.request_id, tenant.owner, body["status"], body, messages,
                                             input_items(req.input), limit=self.bound(tenant)))
        except StoreFull as exc:
            raise self._full(exc) from None
        except IdTaken:
            raise _id_taken(req.request_id) from None

    def _stream(self, serving: Any, req: Any, events: Any, tenant: Tenant | None) -> AsyncIterator[str]:
        """vLLM's event stream as SSE; stored (`tenant` given and `store: true`) before its last event goes out."""

        async def sse() -> AsyncIterator[str]:
            try:
                async for event in events:
                    kind = getattr(event, "type", "unknown")
                    if kind == "response.completed" and tenant is not None and req.store:
                        try:
                            await self._keep(serving, req, tenant)
                        except ApiError as exc:  # the answer is complete but could not be kept: say so
                            yield _error_event(exc.code, exc.message, exc.param)
                            return
                    yield f"event: {kind}\ndata: {vllm.event_json(event)}\n\n"
            finally:
                vllm.drop_stored(serving, req.request_id)

        return sse()

    def _stage(self, serving: Any, prev: StoredResponse) -> bool:
        """Put `prev` where `serving`'s `previous_response_id` looks; False if vLLM holds it already."""
        key = (id(serving), prev.id)
        if key not in self._staged and vllm.is_held(serving, prev.id):
            return False
        if key not in self._staged:
            vllm.stage_previous(serving, prev.response, prev.messages)
        self._staged[key] = self._staged.get(key, 0) + 1
        return True

    def _unstage(self, serving: Any, rid: str) -> None:
        key = (id(serving), rid)
        left = self._staged.get(key, 0) - 1
        if left > 0:
            self._staged[key] = left
            return
        self._staged.pop(key, None)
        vllm.drop_stored(serving, rid)

    # ---- background responses ------------------------------------------------------------------

    async def _start_background(self, serving: Any, req: Any, result: Any, scope: RequestScope,
                                tenant: Tenant) -> Any:
        rid = req.request_id
        queued, messages = vllm.peek_stored(serving, rid)
        if hasattr(result, "aclose"):  # a stream: read back from Redis below (any gateway can), not from vLLM
            await result.aclose()
        try:
            await _redis(self.store().create(rid, tenant.owner, "queued", vllm.response_json(queued), messages,
                                             input_items(req.input), background=True, stream=bool(req.stream),
                                             limit=self.bound(tenant)))
        except BaseException as exc:
            await vllm.cancel_background(serving, rid)
            vllm.drop_stored(serving, rid)
            if isinstance(exc, StoreFull):
                raise self._full(exc) from None
            if isinstance(exc, IdTaken):
                raise _id_taken(rid) from None
            raise
        task = vllm.background_task(serving, rid)
        self.running[rid] = serving
        follower = asyncio.get_running_loop().create_task(self._follow(serving, rid, task, scope, bool(req.stream),
                                                                       self.bound(tenant)),
                                                          name=f"follow-{rid}")
        self.followers[rid] = follower

        def done(_t: asyncio.Task) -> None:
            self.followers.pop(rid, None)
            self.running.pop(rid, None)

        follower.add_done_callback(done)
        if req.stream:
            return self._replay(rid, None)
        return queued

    async def _follow(self, serving: Any, rid: str, task: asyncio.Task | None, scope: RequestScope, stream: bool,
                      limit: int) -> None:
        """Run alongside vLLM's task of one background response until it ended, then store its end."""
        st = self.store()
        copied, renewed, started = 0, time.monotonic(), False
        try:
            while task is not None and not task.done():
                await asyncio.wait({task}, timeout=POLL_S if stream else RENEW_S / 4)
                if stream:
                    copied = await self._copy_events(serving, rid, copied)
                output = any(s.t_first_frame is not None for s in scope.sessions)  # the fleet answered
                if time.monotonic() - renewed < RENEW_S and not (output and not started):
                    continue
                renewed = time.monotonic()
                status = await st.renew(rid)
                if status is None or status == "cancelled":  # deleted, or cancelled on another gateway
                    await vllm.cancel_background(serving, rid)
                    break
                if output and not started:
                    started = True
                    rec = await st.get(rid)
                    if rec is not None and rec.status == "queued":
                        await st.mark(rec, "in_progress", {**rec.response, "status": "in_progress"},
                                      leave=("queued",))
            if task is not None:
                await asyncio.wait({task})
                if not task.cancelled() and task.exception() is not None:  # read: answered below, not logged by asyncio
                    log.info("background response %s failed: %r", rid, task.exception())
            if stream:
                copied = await self._copy_events(serving, rid, copied)
            response, messages = vllm.take_stored(serving, rid)
            rec = await st.get(rid)
            if rec is None or not rec.active:
                return  # deleted or cancelled meanwhile: nothing to write
            body = None if response is None else vllm.response_json(response)
            if body is None or body["status"] in ACTIVE or body["status"] == "failed":
                why = _failure(task, self.closing, scope)
                body = with_error(body or rec.response, "failed", why[0], why[1])
                if stream:
                    await st.append_events(rid, [_event_json("error", why[0], why[1], None, copied)])
            await st.finish(rec, body["status"], body, messages, limit=limit)
        except (RedisError, OSError) as exc:
            log.warning("background response %s: cannot reach Redis: %s", rid, exc)
        except Exception:  # noqa: BLE001 - a follower must not die silently: its response would hang
            log.exception("background response %s: its follower failed", rid)
        finally:
            if task is not None and not task.done():
                task.cancel()
            vllm.drop_stored(serving, rid)

    async def _copy_events(self, serving: Any, rid: str, copied: int) -> int:
        events = vllm.stream_events(serving, rid)
        if events is None or len(events) <= copied:
            return copied
        new = [vllm.event_json(e) for e in list(events)[copied:]]
        await self.store().append_events(rid, new)
        return copied + len(new)

    async def _replay(self, rid: str, starting_after: int | None) -> AsyncIterator[str]:
        """A background stream's events as SSE, from Redis (as they come, until its end)."""
        st = self.store()
        index = 0 if starting_after is None else starting_after + 1
        checked = time.monotonic()
        while True:
            events, status = await st.events_after(rid, index)
            if status in ACTIVE and time.monotonic() - checked >= RENEW_S:  # is its gateway still there?
                checked = time.monotonic()
                if (rec := await st.get(rid)) is not None and await self._fail_orphan(st, rec):
                    continue
            ended = status is None or status not in ACTIVE
            if ended:  # events written before the status changed: all of them now
                events, _ = await st.events_after(rid, index)
            for text in events:
                index += 1
                kind = json.loads(text).get("type", "unknown")
                yield f"event: {kind}\ndata: {text}\n\n"
                if kind in TERMINAL_EVENTS:
                    return
            if ended:
                return
            await asyncio.sleep(POLL_S)

    async def close(self) -> None:
        """Shutting down: the background responses this gateway runs end as failed (they cannot go on)."""
        self.closing = True
        for rid, serving in list(self.running.items()):
            task = vllm.background_task(serving, rid)
            if task is not None:
                task.cancel()
        if self.followers:
            await asyncio.wait(list(self.followers.values()), timeout=5)

    # ---- the other routes ------------------------------------------------------------------------

    async def _owned(self, rid: str, tenant: Tenant, param: str = "response_id") -> StoredResponse:
        """The record, if `tenant` may see it; else the 404 of a missing one (vLLM's message)."""
        st = self.store()
        rec = await _redis(st.get(rid))
        if rec is None or not tenant.owns(rec.owner):
            raise ApiError(404, f"Response with id '{rid}' not found.", param=param)
        if await _redis(self._fail_orphan(st, rec)):
            rec = await _redis(st.get(rid)) or rec
        return rec

    async def _fail_orphan(self, st: ResponseStore, rec: StoredResponse) -> bool:
        """A background response whose gateway died (its lease lapsed) will not end by itself: it is
        marked failed (a stream gets an `error` event to end on). Whether it was."""
        if not rec.lease_lapsed(int(time.time() * 1000)):
            return False
        why = "the gateway running this background response stopped before it finished"
        if not await st.mark(rec, "failed", with_error(rec.response, "failed", "server_error", why)):
            return False
        if rec.stream:
            await st.append_events(rec.id, [_event_json("error", "server_error", why, None, -1)])
        return True

    async def _cancel_here(self, rid: str) -> None:
        """vLLM's cancel of a background response this gateway runs (in its model's serving object)."""
        if (serving := self.running.get(rid)) is not None:
            await vllm.cancel_background(serving, rid)

    def _caller(self, request: Request) -> Tenant:
        tenant = self.tenants.authenticate(request)
        self.rate_limiter.check(api_key_of(request))
        return tenant

    def _on(self) -> None:
        if not self.enabled:
            raise ApiError(404, "this gateway keeps no responses ([gateway] response_store_ttl_s = 0)",
                           code="response_store_off")

    def bound(self, tenant: Tenant) -> int:
        """The bytes `tenant`'s stored responses may take (0: no bound)."""
        return self.max_bytes if tenant.response_store_bytes is None else tenant.response_store_bytes

    def _full(self, exc: StoreFull) -> ApiError:
        return ApiError(429, f"the stored responses of this API key take {exc.used} bytes of the {exc.limit} it may "
                             "keep ([gateway] response_store_max_bytes, or its key's response_store_bytes): delete "
                             "some (DELETE /v1/responses/{id}), wait for them to expire, or send `store: false`",
                        code="response_store_full")

    def add_routes(self, app: FastAPI) -> None:
        @app.get("/v1/responses/{response_id}")
        async def retrieve(response_id: str, request: Request, stream: bool = False,
                           starting_after: int | None = None) -> Response:
            tenant = self._caller(request)
            self._on()
            _refuse_include(request)
            rec = await self._owned(response_id, tenant)
            if not stream:
                return JSONResponse(rec.response)
            if not rec.stream:
                raise ApiError(400, "only a background response created with `stream: true` can be streamed "
                                    "again", param="stream")
            return StreamingResponse(_encoded(self._replay(rec.id, starting_after)), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

        @app.post("/v1/responses/{response_id}/cancel")
        async def cancel(response_id: str, request: Request) -> JSONResponse:
            tenant = self._caller(request)
            self._on()
            st = self.store()
            rec = await self._owned(response_id, tenant)
            body = {**rec.response, "status": "cancelled"}
            if not rec.active or not await _redis(st.mark(rec, "cancelled", body)):
                rec = await self._owned(response_id, tenant)
                if rec.status != "cancelled":
                    raise ApiError(400, f"response {response_id!r} is {rec.status}: only a background response "
                                        "still queued or in progress can be cancelled", param="response_id")
                body = rec.response
            await self._cancel_here(response_id)  # here, at once; elsewhere: its follower
            return JSONResponse(body)

        @app.delete("/v1/responses/{response_id}")
        async def delete(response_id: str, request: Request) -> JSONResponse:
            tenant = self._caller(request)
            self._on()
            rec = await self._owned(response_id, tenant)
            await _redis(self.store().delete(rec))
            await self._cancel_here(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})

        @app.get("/v1/responses/{response_id}/input_items")
        async def list_input_items(response_id: str, request: Request, after: str | None = None,
                                   before: str | None = None, limit: int = 20, order: str = "desc") -> JSONResponse:
            tenant = self._caller(request)
            self._on()
            _refuse_include(request)
            if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
                raise ApiError(400, f"limit must be from 1 to {MAX_INPUT_ITEMS_PAGE}, got {limit}", param="limit")
            if order not in ("asc", "desc"):
                raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order")
            rec = await self._owned(response_id, tenant)
            return JSONResponse(page(rec.input_items, after, before, limit, order))


def _refuse_include(request: Request) -> None:
    """`include` (extra output data on a stored response's read) is not kept by the store: refused, not ignored."""
    if "include" in request.query_params or "include[]" in request.query_params:
        raise ApiError(400, "`include` is not supported when reading a stored response: the store keeps the "
                            "response as it was returned; ask for the data with `include` at creation", param="include")


# ---- pure helpers ------------------------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's `input` as the items `GET /v1/responses/{id}/input_items` lists: a string is one
    user message; a message given as `{role, content: "text"}` gets the content parts the API
    lists; every item gets an id if it came without one."""
    from pydantic_core import to_jsonable_python

    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    out = []
    for raw in value or []:
        item = to_jsonable_python(raw)
        if not isinstance(item, dict):
            continue
        item = dict(item)
        if "role" in item and item.get("type", "message") == "message":
            item["type"] = "message"
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            item.setdefault("status", "completed")
        item.setdefault("id", f"{'msg' if item.get('type') == 'message' else 'item'}_{uuid.uuid4().hex}")
        out.append(item)
    return out


def page(items: list[dict[str, Any]], after: str | None, before: str | None, limit: int,
         order: str) -> dict[str, Any]:
    """An OpenAI list object of `items` (stored oldest first) in `order`, after/before an item id."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    ids = [i.get("id") for i in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    end = ids.index(before) if before in ids else len(ordered)
    data = ordered[start:end][:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + len(data) < end}


def _detached(scope: RequestScope) -> RequestScope:
    return dataclasses.replace(scope, sessions=[], preps=[], finals=[], opening=[], error=None, started=False,
                               client_gone=False, counted=False, detached=True)


def _failure(task: asyncio.Task | None, closing: bool, scope: RequestScope) -> tuple[str, str]:
    """(code, message) of a background response that did not complete."""
    if closing:
        return "server_error", "the gateway running this background response stopped before it finished"
    err = scope.error
    if err is None and task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        err = exc if isinstance(exc, ApiError) else None
    if err is not None:
        return ("rate_limit_exceeded" if err.status == 429 else "server_error"), err.message
    return "server_error", "the response failed in the fleet"


def _event_json(kind: str, code: Any, message: str, param: str | None, seq: int) -> str:
    return json.dumps({"type": kind, "code": code, "message": message, "param": param, "sequence_number": seq})


def _error_event(code: Any, message: str, param: str | None) -> str:
    return f"event: error\ndata: {_event_json('error', code, message, param, -1)}\n\n"


def _id_taken(rid: str) -> ApiError:
    return ApiError(400, f"a stored response is named {rid!r} already: choose another request_id",
                    param="request_id", code="response_id_taken")


async def _encoded(chunks: AsyncIterator[str]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield chunk.encode()


async def _redis(awaitable: Any) -> Any:
    try:
        return await awaitable
    except (RedisError, OSError) as exc:
        raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
