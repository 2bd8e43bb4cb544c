"""OpenAI-style errors: one exception class, one JSON shape, the handlers that emit it.

Every error the gateway returns has the body
``{"error": {"message", "type", "param", "code"}}`` so the `openai` client and
other OpenAI tools turn it into their own typed exceptions. Handlers raise
`ApiError`; the app-level handlers installed by `install_handlers` also cover
FastAPI's request validation, malformed JSON and anything unexpected (500,
logged here with its traceback, never sent to the client).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

log = logging.getLogger("skyline.gateway")

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

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_vllm(exc: Exception) -> ApiError:
    """An exception from vLLM's serving code or checks, answered as vLLM's server answers it
    (its status, type, parameter and message). Anything that is neither vLLM's nor one of the
    exception types vLLM maps to client errors is an internal error: logged, never sent."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    if not isinstance(exc, (ValueError, TypeError, OverflowError, NotImplementedError)) and \
            type(exc).__module__.split(".")[0] != "vllm":
        return ApiError(500, "internal error in the Skyline gateway (see its log)", code="internal_error")
    err = create_error_response(exc).error
    return ApiError(int(err.code), err.message, param=err.param, type=err.type, code=int(err.code))


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
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal error in the Skyline gateway (see its log)", code="internal_error").response()


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
