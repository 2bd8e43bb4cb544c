"""OpenAI Batch API on the gateway: files, batches, and the route batch runners send lines to.

  POST /v1/files                    upload a JSONL batch input (multipart, purpose "batch")
  GET  /v1/files (list), /v1/files/{id} (file object), /v1/files/{id}/content (its bytes)
  POST /v1/batches                  create a batch from an uploaded file (queued as an RQ job)
  GET  /v1/batches/{id}, /v1/batches (list, newest first), POST /v1/batches/{id}/cancel
  POST /skyline/batches/{id}/lines/{line}   (for `skyline batch-runner`) run one line, record it

The line route runs the request through this gateway's own OpenAI endpoint,
in process (`httpx.ASGITransport`), with `x-slo-tier` set to the batch tier:
the same auth, validation, admission and queues as any client request. It
records the answer in Redis before replying, and keeps going if the runner
disconnects, so a runner killed mid-request neither loses the answer nor
makes the fleet compute it again. Every route takes the API key like the
others, and answers only about the key's own files and batches (operator
keys: everyone's; gateway/tenants.py): another tenant's id is a 404 with the
message of a missing one. The line route runs the line as the batch's owner.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import redis.asyncio as aioredis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from skyline.gateway.errors import ApiError
from skyline.gateway.prepare import json_body
from skyline.gateway.tenants import Tenant, Tenants, on_behalf_of
from starlette.datastructures import UploadFile
from starlette.requests import Request

from skyline.batch import jobs, jsonl
from skyline.batch.objects import COMPLETION_WINDOWS, batch_object, file_object
from skyline.batch.store import BatchStore, new_batch_id
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys

MULTIPART_OVERHEAD = 64 * 1024  # form framing and the other fields around the file
CLAIM_MARGIN_S = 30  # a line's claim outlives the gateway's own request timeout by this much
MAX_METADATA_KEYS = 16


def batch_router(cfg: SkylineConfig, redis_of: Callable[[], aioredis.Redis | None], tenants: Tenants) -> APIRouter:
    """The batch routes; `redis_of()` gives the app's Redis client (None before start-up)."""
    router = APIRouter()
    keys = Keys(cfg.key_prefix)
    bc = cfg.batch
    holder: dict[str, Any] = {}  # lazily built: the RQ connection, the in-process client
    owner = f"gateway-{uuid.uuid4().hex[:8]}"

    def store() -> BatchStore:
        r = redis_of()
        if r is None:
            raise ApiError(503, "the gateway is not connected to Redis yet", code="redis_unavailable")
        return BatchStore(r, keys, bc.file_ttl_s)

    def rq_conn():
        if "rq" not in holder:
            holder["rq"] = jobs.rq_connection(cfg.redis)
        return holder["rq"]

    async def owned_file(st: BatchStore, tenant: Tenant, file_id: str) -> dict[str, str]:
        """The file's fields, if `tenant` may see it; else the 404 of a missing file."""
        fields = await _redis(st.file_fields(file_id))
        return _found(fields if fields is not None and tenant.owns(fields.get("owner")) else None, "file", file_id)

    async def owned_batch(st: BatchStore, tenant: Tenant, batch_id: str) -> dict[str, str]:
        """The batch's fields, if `tenant` may see it; else the 404 of a missing batch."""
        fields = await _redis(st.batch_fields(batch_id))
        return _found(fields if fields is not None and tenant.owns(fields.get("owner")) else None, "batch", batch_id)

    # ---- files ----------------------------------------------------------------------------

    @router.post("/v1/files")
    async def upload_file(request: Request) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        form = await _limited(request, bc.max_file_bytes + MULTIPART_OVERHEAD).form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise ApiError(400, f"purpose must be \"batch\" (the only kind of file this gateway stores), got "
                                f"{purpose!r}", param="purpose", code="invalid_purpose")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "the form has no file part named 'file'", param="file", code="missing_file")
        content = await upload.read(bc.max_file_bytes + 1)
        if len(content) > bc.max_file_bytes:
            raise ApiError(413, f"the file exceeds the limit of {bc.max_file_bytes} bytes (batch.max_file_bytes)",
                           param="file", code="file_too_large")
        lines = jsonl.count_lines(content)
        if lines == 0:
            raise ApiError(400, "the file has no lines; a batch input has one JSON request per line",
                           param="file", code="empty_file")
        if lines > bc.max_lines:
            raise ApiError(400, f"the file has {lines} lines; the limit is {bc.max_lines} (batch.max_lines)",
                           param="file", code="too_many_lines")
        return await _redis(store().put_file(content, upload.filename or "batch.jsonl", "batch", owner=tenant.owner))

    @router.get("/v1/files")
    async def list_files(request: Request, after: str | None = None, limit: int = 20, order: str = "desc",
                         purpose: str | None = None) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order")
        data, more = await _redis(store().list_files(after, limit, tenant.lists_of, purpose, order == "desc"))
        return _page(data, more)

    @router.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        return file_object(await owned_file(store(), tenant, file_id))

    @router.get("/v1/files/{file_id}/content")
    async def get_file_content(request: Request, file_id: str) -> Response:
        tenant = tenants.authenticate(request)
        st = store()
        await owned_file(st, tenant, file_id)
        content = _found(await _redis(st.file_content(file_id)), "file", file_id)
        return Response(content, media_type="application/octet-stream")

    # ---- batches --------------------------------------------------------------------------

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        spec = await _json_object(request)
        endpoint, window = spec.get("endpoint"), spec.get("completion_window")
        if endpoint not in jsonl.ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(jsonl.ENDPOINTS)}, got {endpoint!r}",
                           param="endpoint", code="invalid_endpoint")
        if window not in COMPLETION_WINDOWS:
            raise ApiError(400, f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got {window!r}",
                           param="completion_window", code="invalid_completion_window")
        metadata = _metadata(spec.get("metadata"))
        st = store()
        file_id = spec.get("input_file_id")
        meta = await _redis(st.file_fields(file_id)) if isinstance(file_id, str) else None
        if meta is None or not tenant.owns(meta.get("owner")):  # another tenant's file reads as a missing one
            raise ApiError(404, f"no file {file_id!r} (upload it with POST /v1/files first)",
                           param="input_file_id", code="file_not_found")
        if meta["purpose"] != "batch":
            raise ApiError(400, f"file {file_id} has purpose {meta['purpose']!r}, not \"batch\"",
                           param="input_file_id", code="invalid_purpose")
        content = await _redis(st.file_content(file_id))
        if content is None:
            raise ApiError(404, f"file {file_id} has expired", param="input_file_id", code="file_not_found")
        parsed = await asyncio.to_thread(jsonl.parse_input, content, endpoint, bc.max_lines)
        bid, now = new_batch_id(), int(time.time())
        await _redis(st.create_batch({
            "id": bid, "endpoint": endpoint, "input_file_id": file_id, "completion_window": window,
            "status": "validating", "created_at": now, "expires_at": now + COMPLETION_WINDOWS[window],
            "total": parsed.total, "completed": 0, "failed": 0,
            "metadata": json.dumps(metadata) if metadata is not None else None, "owner": tenant.owner or None,
        }))
        if parsed.fatal:  # cannot start: say why, per OpenAI (status failed, errors.data with line numbers)
            await _redis(st.fail(bid, parsed.fatal))
            return await _redis(st.batch(bid))
        for err in parsed.errors:  # bad lines are answered now, in the error file
            await _redis(st.record(bid, err.line, jsonl.error_line(err.custom_id, err.code, err.message)))
        try:
            await asyncio.to_thread(jobs.enqueue_batch, rq_conn(), keys, bc, bid, window, parsed.total)
        except (RedisError, OSError, ValueError) as exc:
            await _redis(st.fail(bid, [jsonl.LineError(None, None, "queue_unavailable",
                                                       f"could not queue the batch job on RQ: {exc}")]))
        return await _redis(st.batch(bid))

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        return batch_object(await owned_batch(store(), tenant, batch_id))

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
        return _page(*await _redis(store().list_batches(after, limit, tenant.lists_of)))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
        tenant = tenants.authenticate(request)
        st = store()
        fields = await owned_batch(st, tenant, batch_id)
        moved, was = await _redis(st.transition(batch_id, ("validating", "in_progress"), "cancelling",
                                                cancelling_at=int(time.time())))
        if not moved and was not in ("cancelling", "cancelled"):
            raise ApiError(409, f"cannot cancel a batch whose status is {was!r}", code="batch_not_cancellable")
        # A job still waiting in RQ will never run: end the batch here. A running one is
        # ended by its runner, which sees `cancelling` within one pacing interval.
        if moved and was == "validating" and await asyncio.to_thread(jobs.cancel_queued, rq_conn(), batch_id):
            content = await _redis(st.file_content(fields["input_file_id"])) or b""
            parsed = await asyncio.to_thread(jsonl.parse_input, content, fields["endpoint"], bc.max_lines)
            await _redis(st.finalize(batch_id, parsed.custom_ids(), "cancelled", "batch_cancelled",
                                     "the batch was cancelled before this request ran"))
        return await _redis(st.batch(batch_id))

    # ---- one line, for the runner -----------------------------------------------------------

    @router.post("/skyline/batches/{batch_id}/lines/{line}")
    async def run_line(request: Request, batch_id: str, line: int) -> Response:
        # Batch runners call this with an operator key (any tenant's batch); a tenant may run only its own.
        tenant = tenants.authenticate(request)
        item = await _json_object(request)
        custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
        if url not in jsonl.ENDPOINTS or not isinstance(body, dict):
            raise ApiError(400, "a batch line needs 'url' (a batch endpoint) and 'body' (an object)", code="invalid_line")
        st = store()
        fields = await owned_batch(st, tenant, batch_id)
        status, batch_owner = fields["status"], fields.get("owner", "")
        if status != "in_progress":
            raise ApiError(409, f"batch {batch_id} is {status}, not running", code="batch_not_running")
        if (done := await _redis(st.result(batch_id, line))) is not None:
            return JSONResponse({"recorded": False, "line": done})
        claim_ttl = int(cfg.gateway.request_timeout_s) + CLAIM_MARGIN_S
        if not await _redis(st.claim(batch_id, line, claim_ttl, owner)):
            raise ApiError(409, f"line {line} of batch {batch_id} is running on a gateway now", code="line_in_progress")
        try:
            if (done := await _redis(st.result(batch_id, line))) is not None:  # recorded just before the claim
                return JSONResponse({"recorded": False, "line": done})
            with on_behalf_of(batch_owner):  # the request (its timeline) is the batch owner's, not the runner's
                status_code, request_id, answer = await _run_inner(request, url, {**body, "stream": False})
            if status_code in jsonl.RETRYABLE_STATUSES:  # not this line's answer: the runner tries again later
                return JSONResponse(answer, status_code=status_code)
            out = jsonl.response_line(custom_id, status_code, request_id, answer)
            recorded = await _redis(st.record(batch_id, line, out))
            return JSONResponse({"recorded": recorded, "line": out if recorded else await _redis(st.result(batch_id, line))})
        finally:
            await _redis(st.release(batch_id, line))

    async def _run_inner(request: Request, url: str, body: dict[str, Any]) -> tuple[int, str | None, Any]:
        """POST `body` to this gateway's own `url`, in process; (status, request id, JSON answer)."""
        if "inner" not in holder:
            holder["inner"] = httpx.AsyncClient(transport=httpx.ASGITransport(app=request.app, raise_app_exceptions=False),
                                                base_url="http://skyline-gateway", timeout=None)
        headers = {"x-slo-tier": bc.tier}
        # The runner's credentials, and its batch span's trace context: the line's request joins its trace.
        for name in ("authorization", "traceparent", "tracestate"):
            if value := request.headers.get(name):
                headers[name] = value
        resp = await holder["inner"].post(url, json=body, headers=headers)
        try:
            answer = resp.json()
        except ValueError:
            answer = {"error": {"message": resp.text[:1000], "type": "server_error", "param": None, "code": None}}
        return resp.status_code, resp.headers.get("x-skyline-request-id"), answer

    return router


def _limited(request: Request, limit: int) -> Request:
    """`request` whose body reads fail with 413 past `limit` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"upload of {declared} bytes exceeds the limit of {limit} bytes", code="file_too_large")
    seen = 0

    async def receive():
        nonlocal seen
        message = await request.receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise ApiError(413, f"upload exceeds the limit of {limit} bytes", code="file_too_large")
        return message

    return Request(request.scope, receive)


async def _json_object(request: Request) -> dict[str, Any]:
    return json_body(await request.body())


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in value.items())):
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA_KEYS} string pairs "
                            "(keys up to 64 characters, values up to 512)", param="metadata", code="invalid_metadata")
    return value


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """An OpenAI list object (files, batches)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _found(value: Any, what: str, ident: str) -> Any:
    if value is None:
        raise ApiError(404, f"no {what} {ident!r}", code=f"{what}_not_found")
    return value


async def _redis(awaitable):
    try:
        return await awaitable
    except (RedisError, OSError) as exc:
        raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
