"""OpenAI-style errors: one exception class, one JSON shape, the handlers that emit it.

Every error the gateway returns has the body
``{"error": {"message", "type", "param", "code"}}`` so the `openai` client and
other OpenAI tools turn it into their own typed exceptions. Handlers raise
`ApiError`; the app-level handlers installed by `install_handlers` also cover
FastAPI's request validation, malformed JSON and anything unexpected.

A failure that is not the client's (an unexpected exception, a chat template or
tokenizer that crashes) is answered with one generic message naming a request
id, also sent as `x-skyline-request-id`; its traceback is logged here under that
id. An exception's text never reaches a client: it can name files, hosts,
configuration or another request's data, and it never says what to fix.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from skyline.gateway import vllm_serving_internals

log = logging.getLogger("skyline.gateway")

REQUEST_ID_HEADER = "x-skyline-request-id"

# OpenAI's `type` for each status; the client maps statuses to exception classes itself.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """An error to return to the client as OpenAI error JSON with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers
        # A request's session closed with this status already recorded it (request counter, timeline,
        # SLO record): whoever passes the error on must not record it again.
        self.recorded = False

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_vllm(exc: Exception, request_id: str | None = None) -> ApiError:
    """An exception from vLLM's serving code or checks, answered as vLLM's server answers it
    (its status, type, parameter and message) where vLLM wrote that message (`vllm_wrote`).
    Anything else is an internal error: logged with its traceback under `request_id` (a new id
    when the request has none yet), answered with `internal_error`."""
    if not vllm_wrote(exc):
        request_id = request_id or new_request_id()
        log.error("internal error, request id %s", request_id, exc_info=exc)
        return internal_error(request_id)
    err = vllm_serving_internals.error_info(exc)
    return ApiError(int(err.code), err.message, param=err.param, type=err.type, code=int(err.code))


def new_request_id() -> str:
    """An id for a request that failed before it got one (before vLLM's serving code named it)."""
    return f"gw-{uuid.uuid4().hex}"


def internal_error(request_id: str) -> ApiError:
    """The answer to a failure that is not the client's: the same words whatever failed, and the
    id under which the gateway's log has the details."""
    return ApiError(500, f"internal error in the Skyline gateway (request id {request_id}); its log has the "
                         "details under that id", code="internal_error", headers={REQUEST_ID_HEADER: request_id})


# The bare exception types vLLM's server answers 400 (501) where its code still raises them to
# refuse a request (its fallback handlers: vllm/entrypoints/serve/exception_handling/register.py).
_BARE_CLIENT_TYPES = (ValueError, TypeError, OverflowError, NotImplementedError)


def vllm_wrote(exc: BaseException) -> bool:
    """Whether `exc`'s message was written for the client by vLLM's code (or Skyline's, raising
    vLLM's exception types), rather than being the text of a failure somewhere inside.

    vLLM's: its own exception types; the bare ValueError & co. its code raises itself, or that the
    standard library raises on a value vLLM's code handed it (`int()`, `json.loads`); and a chat
    template's `raise_exception(...)`, its author's word to the client ("roles must alternate").
    Not vLLM's: the same bare types raised by a tokenizer, a library or Skyline's own code, and a
    vLLM error that only passes on the text of a crash: vLLM answers whatever rendering the chat
    template raised (an undefined variable, a TypeError in the template) as a 400 carrying that
    text (renderers/hf.py, `safe_apply_chat_template`), which is the template's failure, not the
    client's. What it passes on from a plain ValueError that transformers raised to refuse the
    conversation ("Cannot apply chat template to an empty conversation") stays the client's."""
    if _template_says(exc):
        return True
    if vllm_serving_internals.is_vllm_type(exc):
        return _passed_on(exc) is None
    return (isinstance(exc, _BARE_CLIENT_TYPES) and vllm_serving_internals.raised_in_vllm(exc)
            and _passed_on(exc) is None)


def _template_says(exc: BaseException) -> bool:
    # transformers' `raise_exception` raises jinja2's base TemplateError; jinja2 itself raises only
    # its subclasses (undefined variables, syntax errors, sandbox violations).
    return type(exc).__module__ == "jinja2.exceptions" and type(exc).__name__ == "TemplateError"


def _passed_on(exc: BaseException) -> BaseException | None:
    """The crash whose text `exc` carries as its message (vLLM wraps it with `raise ... from`), if
    any: an exception that is neither vLLM's, nor a template's `raise_exception`, nor a library's
    plain ValueError refusing a value (raised by its code, not by the template's)."""
    message = str(exc.args[0]) if exc.args else ""
    seen: set[int] = set()
    inner = exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        refusal = vllm_serving_internals.is_vllm_type(inner) or _template_says(inner) or (
            type(inner) is ValueError and not _in_template(inner))
        if not refusal and str(inner) == message:
            return inner
        inner = inner.__cause__ or inner.__context__
    return None


def _in_template(exc: BaseException) -> bool:
    """Whether `exc` was raised while the chat template ran (through Jinja's code, or the template's
    own frames, which Jinja names `<template>`), rather than by the code around it."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename == "<template>" or frame.f_globals.get("__name__", "").startswith("jinja2"):
            return True
        tb = tb.tb_next
    return False


def from_validation(errors: list[dict[str, Any]]) -> ApiError:
    """A 400 naming the first offending field (as a dotted path) and what is wrong with it.

    Accepts the error list of a pydantic `ValidationError` or FastAPI's
    `RequestValidationError`; malformed JSON shows up there as `json_invalid`.
    """
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    # pydantic puts union member names ("str", "list[int]", "function-after[...]") in the
    # location; they mean nothing to a client, so keep only field names and list indices.
    loc = [p for p in loc if not _is_type_label(p)]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error") or err.get("msg", "")
        return ApiError(400, f"request body is not valid JSON: {detail}", code="invalid_json")
    if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return ApiError(400, "request body must be a JSON object", code="invalid_json")
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    if kind == "missing":
        message = f"'{param}' is a required field"
    else:
        message = f"invalid '{param}': {msg}" if param else msg
    more = len(errors) - 1
    if more > 0 and kind != "missing":
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ApiError(400, message, param=param, code="invalid_value" if kind != "missing" else "missing_field")


def _is_type_label(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "list[str]", "list[int]", "dict", "none")
        or part.startswith(("function-", "list[", "union[", "tagged-union[", "lax-", "strict-"))
    )


def install_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation(exc.errors()).response()

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc: Exception) -> JSONResponse:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, _exc: Exception) -> JSONResponse:
        return ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                        type="invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = new_request_id()
        log.error("unhandled error on %s %s, request id %s", request.method, request.url.path, request_id,
                  exc_info=exc)
        return internal_error(request_id).response()


class HeaderLimit:
    """ASGI middleware: refuse requests whose headers exceed `max_bytes` in total
    with 431 in the OpenAI error shape, before any route (or body read) runs.
    The HTTP server's own limits are far larger (httptools sets none), and every
    header is held in memory for the life of the request."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.max_bytes > 0:
            size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            if size > self.max_bytes:
                resp = ApiError(431, f"request headers are {size} bytes; the limit is {self.max_bytes}",
                                type="invalid_request_error", code="headers_too_large").response()
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
