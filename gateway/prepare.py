"""From an HTTP request to a `GenerateRequest`: auth, body, SLO, route.

vLLM's serving layer (gateway/openai_api.py) validates the body, renders and
tokenizes the prompt and builds the sampling parameters; what is Skyline's is
here: who may ask, how large a body may be, the request's SLO (tier, targets,
deadline) and its route through the fleet. Everything runs before anything
touches Redis, so a refused request leaves no trace in the queues. Each check
raises `ApiError` with the OpenAI status, type and a message that names the
offending value.
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from skyline.core.config import SkylineConfig
from skyline.core.messages import GenerateRequest, SamplingSpec
from skyline.core.streams import Placement
from skyline.scheduler.disagg import DisaggPolicy, route
from skyline.scheduler.tiers import Slo, SloError, TierNotAllowed, resolve_slo

from skyline.gateway.errors import ApiError, from_validation

ROUTES = ("disagg", "colocated")


class SloSpec(BaseModel):
    """Skyline extension: `"slo": {"tier": "interactive", "ttft_ms": 500, "tpot_ms": 100}`.

    Targets may only tighten the tier's (see `skyline.scheduler.tiers.resolve_slo`).
    The headers `x-slo-tier`, `x-slo-ttft-ms`, `x-slo-tpot-ms` take precedence.
    """

    model_config = ConfigDict(extra="forbid")

    tier: str | None = None
    ttft_ms: int | None = Field(default=None, gt=0)
    tpot_ms: int | None = Field(default=None, gt=0)
    allow_demotion: bool = False  # header x-slo-allow-demotion: true


@dataclass(frozen=True)
class Serving:
    """What the gateway serves: fixed for the life of the app."""

    cfg: SkylineConfig
    served_model: str

    @property
    def policy(self) -> DisaggPolicy:
        g = self.cfg.gateway
        return DisaggPolicy(g.mode, g.min_remote_prefill_tokens, g.max_prefill_backlog_tokens)


@dataclass
class Prepared:
    """A validated request, ready to enqueue."""

    kind: str  # the route: "chat", "completion", "responses", "messages" (Anthropic), "scoring", "decision"
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
    t_prepared: float = 0.0  # perf_counter() once vLLM's serving code had rendered it and Skyline prepared it
    # Prefix affinity (gateway/affinity.py): the worker it waits for, and the prompt tokens left to
    # compute where it will run (None: all of them), what admission and the backlog count.
    placement: Placement | None = None
    uncached_tokens: int | None = None

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens its prefill will compute: what admission control and the backlog count."""
        return len(self.request.prompt_token_ids) if self.uncached_tokens is None else self.uncached_tokens


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


def json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (vLLM's request models validate its fields)."""
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
        # JSON lets a string hold an unpaired UTF-16 surrogate (`"\udcff"`), which is no Unicode text:
        # the tokenizer fails on it. Only a body with a `\ud` escape can hold one (raw UTF-8 cannot),
        # so the cheap test on the bytes spares every other body the check of its strings.
        text_ok = not (b"\\ud" in raw or b"\\uD" in raw) or _valid_unicode(body)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # `[[[[...]]]]` some thousand levels deep: Python's parser recurses per level
        raise ApiError(400, "request body nests arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if not text_ok:
        raise ApiError(400, "request body has a string with an unpaired surrogate escape (\\ud800-\\udfff); "
                            "send valid Unicode text", code="invalid_json")
    return body


def _valid_unicode(body: Any) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # UTF-8 has no encoding for a lone surrogate
    except UnicodeEncodeError:
        return False
    return True


def pop_slo(body: dict[str, Any]) -> SloSpec | None:
    """Take Skyline's `slo` extension out of the body (vLLM's models would log it as ignored)."""
    spec = body.pop("slo", None)
    if spec is None:
        return None
    try:
        return SloSpec.model_validate(spec)
    except ValidationError as exc:
        err = from_validation([{**e, "loc": ("slo", *e.get("loc", ()))} for e in exc.errors()])
        raise ApiError(400, err.message, param=err.param, code="invalid_slo") from None


def sampling_spec(params: Any) -> SamplingSpec:
    """Skyline's view of vLLM `SamplingParams`, carrying the whole of them in `params`."""
    import msgspec

    return SamplingSpec(
        max_tokens=int(params.max_tokens or 0), temperature=float(params.temperature), top_p=float(params.top_p),
        top_k=int(params.top_k or 0) if (params.top_k or 0) > 0 else 0, seed=params.seed,
        stop=list(params.stop or []), stop_token_ids=list(params.stop_token_ids or []),
        ignore_eos=bool(params.ignore_eos), presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty), n=int(params.n),
        params=msgspec.to_builtins(params),
    )


def prepare(serving: Serving, kind: str, request: Request, spec: SloSpec | None, request_id: str,
            prompt_ids: list[int], params: Any, stream: bool, include_usage: bool, arrival_ms: int,
            t_arrival: float, cache_salt: str | None = None, strictest_tier: str = "") -> Prepared:
    """The message to enqueue for one prompt of a request vLLM's serving layer has validated;
    `strictest_tier`: the strictest tier its tenant may use ("" = any)."""
    slo = _slo(serving.cfg, spec, request, arrival_ms, strictest_tier)
    path = _route(serving, request, len(prompt_ids))
    gen = GenerateRequest(
        request_id=request_id,
        model=serving.served_model,
        prompt_token_ids=prompt_ids,
        sampling=sampling_spec(params),
        tier=slo.tier,
        arrival_ms=arrival_ms,
        deadline_ms=slo.deadline_ms,
        ttft_ms=slo.ttft_ms,
        tpot_ms=slo.tpot_ms,
        priority=slo.priority,
        route=path,
        cache_salt=cache_salt,
        best_effort=not asks_for_slo(request, spec),
    )
    demotion = request.headers.get("x-slo-allow-demotion", "").lower() in ("1", "true", "yes") or bool(
        spec and spec.allow_demotion)
    return Prepared(kind, gen, slo, path, stream, include_usage, int(time.time()), t_arrival,
                    allow_demotion=demotion, route_fixed="x-skyline-route" in request.headers,
                    t_prepared=time.perf_counter())


SLO_HEADERS = ("x-slo-tier", "x-slo-ttft-ms", "x-slo-tpot-ms")


def asks_for_slo(request: Request, spec: SloSpec | None) -> bool:
    """Did the client name a tier or a target (a header, or the body's `slo` field)? One that did not is
    served best effort: held to no TTFT target by admission, never dropped for lateness."""
    return spec is not None or any(request.headers.get(h) for h in SLO_HEADERS)


def _slo(cfg: SkylineConfig, spec: SloSpec | None, request: Request, arrival_ms: int, strictest_tier: str = "") -> Slo:
    """Tier and targets: headers win over the body's `slo` extension, both over tier defaults;
    a tier stricter than the tenant may use is a 403 naming the tiers it may."""
    h = request.headers
    tier = h.get("x-slo-tier") or (spec.tier if spec else None)
    ttft = _int_header(h.get("x-slo-ttft-ms"), "x-slo-ttft-ms")
    tpot = _int_header(h.get("x-slo-tpot-ms"), "x-slo-tpot-ms")
    if ttft is None and spec:
        ttft = spec.ttft_ms
    if tpot is None and spec:
        tpot = spec.tpot_ms
    try:
        return resolve_slo(cfg.tiers, cfg.default_tier, arrival_ms, tier=tier, ttft_ms=ttft, tpot_ms=tpot,
                           strictest=strictest_tier)
    except TierNotAllowed as exc:
        header = "x-slo-ttft-ms" if exc.by_target else "x-slo-tier"
        param = header if h.get(header) else "slo.ttft_ms" if exc.by_target else "slo.tier"
        raise ApiError(403, str(exc), param=param, code="tier_not_allowed") from None
    except SloError as exc:
        raise ApiError(400, str(exc), param="slo", code="invalid_slo") from None


def _int_header(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(float(value))
    except (ValueError, OverflowError):  # "abc", "nan"; "inf", "1e400" (float() gives inf, int() refuses it)
        shown = value if len(value) <= 40 else value[:40] + "..."  # a header may be kilobytes long
        raise ApiError(400, f"header {name} must be a finite number of milliseconds such as 500, got {shown!r}",
                       param=name, code="invalid_slo") from None


def _route(serving: Serving, request: Request, prompt_len: int) -> str:
    override = request.headers.get("x-skyline-route")
    if override:
        if override not in ROUTES:
            raise ApiError(400, f"header x-skyline-route must be one of {', '.join(ROUTES)}, got {override!r}",
                           param="x-skyline-route")
        return override
    return route(serving.policy, prompt_len)


def needed_stages(path: str) -> tuple[str, ...]:
    """Stages a request on `path` passes through (each needs a live worker that consumes it)."""
    return ("prefill", "decode") if path == "disagg" else ("decode",)
