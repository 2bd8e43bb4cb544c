"""From an HTTP request to a `GenerateRequest`: auth, body, parse, tokenize, size, SLO, route.

Everything here runs before anything touches Redis, so a request rejected by
any check leaves no trace in the queues. Each check raises `ApiError` with
the OpenAI status, type and a message that names the offending value.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError
from starlette.requests import Request

from skyline.config import SkylineConfig
from skyline.messages import GenerateRequest
from skyline.scheduler.disagg import DisaggPolicy, route
from skyline.scheduler.tiers import Slo, SloError, resolve_slo
from skyline.tokenizer import Tokenizer

from skyline.gateway.errors import ApiError, from_validation
from skyline.gateway.schemas import ChatCompletionRequest, CompletionRequest, _Common

# Tokenizing a long prompt can take milliseconds of CPU; off the event loop it
# does not stall every other stream. Short prompts are cheaper inline than a thread hop.
TOKENIZE_IN_THREAD_CHARS = 2000
ROUTES = ("disagg", "colocated")

Body = TypeVar("Body", bound=_Common)


@dataclass(frozen=True)
class Serving:
    """What the gateway serves: fixed for the life of the app."""

    cfg: SkylineConfig
    tokenizer: Tokenizer
    served_model: str
    max_model_len: int

    @property
    def policy(self) -> DisaggPolicy:
        g = self.cfg.gateway
        return DisaggPolicy(g.mode, g.min_remote_prefill_tokens, g.max_prefill_backlog_tokens)


@dataclass
class Prepared:
    """A validated request, ready to enqueue."""

    kind: str  # "chat" or "completion"
    request: GenerateRequest
    slo: Slo
    route: str
    stream: bool
    include_usage: bool
    created: int  # Unix seconds, the OpenAI `created` field
    t_arrival: float  # perf_counter() at arrival: the origin of the gateway's TTFT/e2e
    allow_demotion: bool = False  # the client accepts a looser tier instead of a 429
    admission: str = "admit"  # admission control's decision ("admit" or "demote")
    predicted_ttft_ms: float | None = None  # admission control's prediction, reported back
    model_ttft_ms: float | None = None  # the same before calibration: what the calibration learns from
    route_fixed: bool = False  # the client chose the route (x-skyline-route): never re-routed


def check_auth(request: Request, api_keys: tuple[str, ...]) -> None:
    if not api_keys:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    # Constant-time comparison: a key must not be guessable from response timing.
    if not any(hmac.compare_digest(token.strip().encode(), k.encode()) for k in api_keys):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused with 413 past `max_bytes` (declared or actually sent) before parsing."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"request body of {size} bytes exceeds the gateway limit of {max_bytes} bytes",
                    code="request_too_large")


def parse(model: type[Body], raw: bytes) -> Body:
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None


async def prepare(serving: Serving, kind: str, body: CompletionRequest | ChatCompletionRequest,
                  request: Request, arrival_ms: int, t_arrival: float) -> Prepared:
    """Validate `body` against what is served and build the message to enqueue."""
    cfg = serving.cfg
    if body.model != serving.served_model:
        raise ApiError(400, f"model {body.model!r} is not served here; this gateway serves {serving.served_model!r}",
                       param="model", code="model_not_found")

    prompt_ids = await _tokenize(serving.tokenizer, body)
    prompt_len = len(prompt_ids)
    limit = serving.max_model_len
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="messages" if kind == "chat" else "prompt")
    if prompt_len > limit - 1:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                            f"{prompt_len} tokens (at most {limit - 1} leave room for one output token)",
                       param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
    asked = body.requested_max_tokens()
    if asked is None:
        max_tokens = min(cfg.gateway.max_tokens_default, limit - prompt_len)
    elif prompt_len + asked > limit:
        field = "max_completion_tokens" if kind == "chat" and body.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but {prompt_len + asked} "
                            f"were requested ({prompt_len} in the prompt, {asked} in {field}); "
                            f"lower {field} to at most {limit - prompt_len}",
                       param=field, code="context_length_exceeded")
    else:
        max_tokens = asked

    slo = _slo(cfg, body, request, arrival_ms)
    path = _route(serving, request, prompt_len)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    gen = GenerateRequest(
        request_id=prefix + uuid.uuid4().hex,
        model=serving.served_model,
        prompt_token_ids=prompt_ids,
        sampling=body.sampling(max_tokens),
        tier=slo.tier,
        arrival_ms=arrival_ms,
        deadline_ms=slo.deadline_ms,
        ttft_ms=slo.ttft_ms,
        tpot_ms=slo.tpot_ms,
        priority=slo.priority,
        route=path,
    )
    demotion = request.headers.get("x-slo-allow-demotion", "").lower() in ("1", "true", "yes") or bool(
        body.slo and body.slo.allow_demotion)
    return Prepared(kind, gen, slo, path, bool(body.stream), body.include_usage(), int(time.time()), t_arrival,
                    allow_demotion=demotion, route_fixed="x-skyline-route" in request.headers)


async def _tokenize(tok: Tokenizer, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list):
        return list(body.prompt)  # already token ids
    if isinstance(body, ChatCompletionRequest):
        fn, arg = tok.apply_chat_template, body.chat_messages()
    else:
        fn, arg = tok.encode, body.prompt
    try:
        if body.prompt_chars() > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(fn, arg)
        return fn(arg)
    except Exception as exc:
        if isinstance(body, ChatCompletionRequest):
            # Chat templates raise on conversations they do not accept (e.g. roles that do not
            # alternate): that is the client's request, not a gateway fault.
            raise ApiError(400, f"the model's chat template rejected the messages: {exc}",
                           param="messages", code="invalid_messages") from None
        raise


def _slo(cfg: SkylineConfig, body: _Common, request: Request, arrival_ms: int) -> Slo:
    """Tier and targets: headers win over the body's `slo` extension, both over tier defaults."""
    spec = body.slo
    h = request.headers
    tier = h.get("x-slo-tier") or (spec.tier if spec else None)
    ttft = _int_header(h.get("x-slo-ttft-ms"), "x-slo-ttft-ms")
    tpot = _int_header(h.get("x-slo-tpot-ms"), "x-slo-tpot-ms")
    if ttft is None and spec:
        ttft = spec.ttft_ms
    if tpot is None and spec:
        tpot = spec.tpot_ms
    try:
        return resolve_slo(cfg.tiers, cfg.default_tier, arrival_ms, tier=tier, ttft_ms=ttft, tpot_ms=tpot)
    except SloError as exc:
        raise ApiError(400, str(exc), param="slo", code="invalid_slo") from None


def _int_header(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(float(value))
    except ValueError:
        raise ApiError(400, f"header {name} must be a number of milliseconds, got {value!r}",
                       param=name, code="invalid_slo") from None


def _route(serving: Serving, request: Request, prompt_len: int) -> str:
    override = request.headers.get("x-skyline-route")
    if override:
        if override not in ROUTES:
            raise ApiError(400, f"header x-skyline-route must be one of {', '.join(ROUTES)}, got {override!r}",
                           param="x-skyline-route")
        return override
    return route(serving.policy, prompt_len)


def needed_roles(path: str) -> tuple[str, ...]:
    """Worker roles a request on `path` passes through."""
    return ("prefill", "decode") if path == "disagg" else ("decode",)
