"""The gateway's FastAPI app: OpenAI-compatible endpoints in front of the Redis fleet.

Request path (each step can refuse with an OpenAI error before the next runs,
so a refused request never reaches a queue):
auth -> body size -> validation -> model -> tokenize -> context length ->
SLO -> route -> needed worker roles alive -> subscribe (confirmed) -> enqueue
-> relay frames to the client (SSE or one JSON body) -> unsubscribe.
Abandoned requests (client gone, timeout) are cancelled in the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline import messages, redisconn
from skyline.config import SkylineConfig
from skyline.gateway.admission import apply_admission, learn, policy_of, stage_of
from skyline.gateway.batch_routes import batch_router
from skyline.gateway.dashboard import add_dashboard_routes
from skyline.gateway.errors import ApiError, HeaderLimit, install_handlers
from skyline.gateway.fleetview import START_HINT, FleetView
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.observe import GatewayObserver, add_timeline_route, api_key_of
from skyline.gateway.ratelimit import KeyRateLimiter
from skyline.gateway.prepare import Prepared, Serving, check_auth, needed_roles, parse, prepare, read_body
from skyline.gateway.relay import Relay, RelayUnavailable
from skyline.gateway.responses import DONE, Shaper, error_event
from skyline.gateway.schemas import ChatCompletionRequest, CompletionRequest
from skyline.gateway.session import Disconnected, Session
from skyline.keys import Keys
from skyline.scheduler.admission import TtftCalibration
from skyline.scheduler.disagg import route
from skyline.scheduler.rate_limit import RateLimit
from skyline.streams import enqueue, ensure_groups, now_ms, release_backlog
from skyline.tokenizer import Tokenizer

log = logging.getLogger("skyline.gateway")

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; only seen in metrics


@dataclass
class _State:
    """Connections owned by the app's lifespan."""

    redis: aioredis.Redis | None = None
    relay: Relay | None = None
    fleet: FleetView | None = None
    background: set[asyncio.Task] = field(default_factory=set)  # cancel publishes in flight


def create_app(cfg: SkylineConfig, tokenizer: Tokenizer, served_model: str, max_model_len: int) -> FastAPI:
    """The gateway app. Its lifespan connects Redis (`cfg.redis.url`), creates the consumer
    groups, starts the token relay and the worker-role cache; shutting down closes them."""
    serving = Serving(cfg, tokenizer, served_model, max_model_len)
    keys = Keys(cfg.key_prefix)
    metrics = GatewayMetrics()
    observer = GatewayObserver(cfg, metrics, keys)  # timeline events, SLO verdicts, the rolling SLO record
    admission_policy = policy_of(cfg)
    calibration = TtftCalibration() if cfg.gateway.ttft_calibration else None
    rate_limiter = KeyRateLimiter(RateLimit(cfg.gateway.rate_limit_rps, cfg.gateway.rate_limit_burst))
    state = _State()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # A blocking pool: a burst of requests waits (briefly) for a connection instead of
        # failing with "Too many connections" (seen at 128 concurrent streams).
        r = redisconn.connect(cfg.redis, max_connections=64, blocking_timeout_s=5)
        try:
            await ensure_groups(r, keys, cfg.tier_names)
            relay = Relay(cfg.redis, keys)
            await relay.start()
            fleet = FleetView(r, keys, cfg.gateway.worker_liveness_s)
            await fleet.start()
        except BaseException:
            await r.aclose()
            raise
        state.redis, state.relay, state.fleet = r, relay, fleet
        observer.start(r)
        log.info("gateway serving %r (max_model_len %d, mode %s) with Redis at %s",
                 served_model, max_model_len, cfg.gateway.mode, redisconn.describe(cfg.redis))
        try:
            yield
        finally:
            await fleet.close()
            await observer.close()
            await relay.close()
            if state.background:  # let pending cancels reach Redis
                await asyncio.wait(state.background, timeout=2.0)
            await r.aclose()

    app = FastAPI(title="Skyline gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    app.add_middleware(HeaderLimit, max_bytes=cfg.gateway.max_header_bytes)
    app.include_router(batch_router(cfg, lambda: state.redis))  # OpenAI Batch API (gateway/batch_routes.py)

    async def generate(request: Request, kind: str) -> Response:
        t_arrival = time.perf_counter()
        arrival_ms = now_ms()
        prep: Prepared | None = None
        try:
            check_auth(request, cfg.gateway.api_keys)
            rate_limiter.check(api_key_of(request))  # before any work: a flooding tenant costs the least
            raw = await read_body(request, cfg.gateway.max_body_bytes)
            body = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, raw)
            prep = await prepare(serving, kind, body, request, arrival_ms, t_arrival)
            session = await _submit(prep)
            prep = session.prep  # admission control may have demoted it
            observer.enqueued(prep, request, session.t_enqueue_ms)
        except ApiError as exc:
            metrics.count(prep.slo.tier if prep else "", prep.route if prep else "", exc.status)
            observer.refused(prep, request, exc)
            raise
        headers = {"x-skyline-request-id": prep.request.request_id, "x-skyline-tier": prep.slo.tier,
                   "x-skyline-route": prep.route}
        try:
            if prep.stream:
                return await _stream(session, request, headers)
            return await _collect(session, request, headers)
        except ApiError as exc:
            exc.headers = {**(exc.headers or {}), **headers}
            raise

    async def _submit(prep: Prepared) -> Session:
        """Check the fleet can serve the request, subscribe to its output, enqueue it."""
        fleet, relay, r = state.fleet, state.relay, state.redis
        assert fleet is not None and relay is not None and r is not None
        if not prep.route_fixed and prep.route == "disagg":
            # Queue depth is part of the route decision: re-decide with the cached prefill backlog.
            path = route(serving.policy, len(prep.request.prompt_token_ids), fleet.prefill_backlog_tokens)
            if path != prep.route:
                prep = replace(prep, route=path, request=replace(prep.request, route=path))
        missing = await fleet.missing(needed_roles(prep.route))
        if fleet.error:
            raise ApiError(503, f"the gateway cannot reach Redis ({fleet.error})", code="redis_unavailable")
        if missing:
            hint = " and ".join(f"`{START_HINT[role]}`" for role in missing)
            raise ApiError(503, f"no live {' or '.join(missing)} worker for the {prep.route} route; "
                                f"start one with {hint}", code="no_workers",
                           headers={"Retry-After": "1"})
        if cfg.gateway.admission:
            try:
                prep = await apply_admission(cfg, admission_policy, r, keys, fleet, prep, metrics, calibration)
            except (RedisError, OSError) as exc:
                raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
        try:
            return await _subscribe_and_enqueue(prep)
        except ApiError:
            if cfg.gateway.admission:  # the reservation made by admission control is void
                with contextlib.suppress(RedisError, OSError):
                    await release_backlog(r, keys, stage_of(prep.route), prep.request.tier,
                                          len(prep.request.prompt_token_ids))
            raise

    async def _subscribe_and_enqueue(prep: Prepared) -> Session:
        relay, r = state.relay, state.redis
        assert relay is not None and r is not None
        try:
            sub = await relay.subscribe(prep.request.request_id)
        except RelayUnavailable as exc:
            raise ApiError(503, str(exc), code="relay_unavailable") from None
        session = Session(prep, sub, relay, r, keys, cfg.gateway, metrics, state.background)
        session.on_close.append(observer.closed)
        if calibration is not None:
            session.on_close.append(functools.partial(learn, calibration))
        if prep.route == "disagg":
            stage, msg = "prefill", prep.request
        else:
            stage, msg = "decode", messages.DecodeWork(request=prep.request, kv_handle=None)
        try:
            session.t_enqueue_ms = now_ms()  # before the XADD: no worker's claim can look earlier
            await enqueue(r, keys, stage, msg, cfg.redis.stream_maxlen, backlog_reserved=cfg.gateway.admission)
        except (RedisError, OSError) as exc:
            session.finished = True  # never enqueued: nothing to cancel
            session.close(503)
            raise ApiError(503, f"could not enqueue the request: {exc}", code="redis_unavailable") from None
        return session

    async def _collect(session: Session, request: Request, headers: dict[str, str]) -> Response:
        """Non-streaming: gather the output, answer once."""
        shaper = Shaper(session.prep.kind, session.request_id, served_model, session.prep.created)
        texts: list[str] = []
        status = 500
        fin = None
        try:
            while True:
                for f in await session.frames(request):
                    if isinstance(f, messages.TokenDelta):
                        texts.append(f.text)
                    elif isinstance(f, messages.Finished):
                        fin = f
                        status = 200
                        body = shaper.body("".join(texts), f.finish_reason, session.usage(f), session.skyline(f))
                        return JSONResponse(body, headers=headers)
                    elif isinstance(f, messages.Failed):
                        err = _failed_error(f)
                        status = err.status
                        raise err
        except Disconnected:
            status = CLIENT_CLOSED
            session.cancel("client_disconnected")
            return Response(status_code=CLIENT_CLOSED)
        except ApiError as exc:
            status = exc.status
            session.cancel("timeout" if exc.status in (503, 504) else "gateway_abort")
            raise
        finally:
            session.close(status, fin)

    async def _stream(session: Session, request: Request, headers: dict[str, str]) -> Response:
        """Streaming: wait for the first frame before committing to 200, so that a request
        that fails before producing anything still gets a real HTTP error status."""
        try:
            first = await session.frames(request)
        except Disconnected:
            session.cancel("client_disconnected")
            session.close(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException as exc:
            if isinstance(exc, ApiError):
                session.cancel("timeout")
            session.close(getattr(exc, "status", 500))
            raise
        if isinstance(first[0], messages.Failed):
            err = _failed_error(first[0])
            session.close(err.status)
            raise err
        shaper = Shaper(session.prep.kind, session.request_id, served_model, session.prep.created)
        return StreamingResponse(_sse(session, shaper, first), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})

    async def _sse(session: Session, shaper: Shaper, batch: list[messages.Message]) -> AsyncIterator[bytes]:
        status, fin = 200, None
        out: list[bytes] = [shaper.role()] if shaper.chat else []
        try:
            while True:
                carry = ""
                for i, f in enumerate(batch):
                    if isinstance(f, messages.TokenDelta):
                        if i + 1 < len(batch) and isinstance(batch[i + 1], messages.Finished):
                            carry = f.text  # the finish chunk carries the last text: one chunk fewer
                            continue
                        if f.text:
                            out.append(shaper.content(f.text))
                    elif isinstance(f, messages.Finished):
                        fin = f
                        ext = session.skyline(f)
                        if session.prep.include_usage:
                            out.append(shaper.finish(carry, f.finish_reason, None))
                            out.append(shaper.usage_chunk(session.usage(f), ext))
                        else:
                            out.append(shaper.finish(carry, f.finish_reason, ext))
                        out.append(DONE)
                        yield b"".join(out)
                        return
                    elif isinstance(f, messages.Failed):
                        status = f.status
                        out += (error_event(f), DONE)
                        yield b"".join(out)
                        return
                if out:
                    yield b"".join(out)
                    out = []
                try:
                    batch = await session.frames()
                except ApiError as exc:
                    status = exc.status
                    session.cancel("timeout")
                    yield error_event(messages.Failed(session.request_id, 0, exc.status, exc.message,
                                                      exc.type, exc.code)) + DONE
                    return
        except BaseException:
            # Cancelled by Starlette when the client disconnects (or the generator was closed):
            # close() below cancels the request in the fleet without awaiting.
            status = CLIENT_CLOSED
            raise
        finally:
            session.close(status, fin)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request, cfg.gateway.api_keys)
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": started,
                                             "owned_by": "skyline", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        r, fleet, relay = state.redis, state.fleet, state.relay
        try:
            assert r is not None and fleet is not None and relay is not None
            async with asyncio.timeout(1.0):
                await r.ping()
        except (RedisError, OSError, TimeoutError, AssertionError) as exc:
            return JSONResponse({"status": "unavailable", "error": f"Redis does not answer: {exc}"}, status_code=503)
        body = {"status": "ok" if relay.connected else "degraded", "workers": dict(fleet.roles),
                "relay_connected": relay.connected, "in_flight": relay.in_flight}
        return JSONResponse(body, status_code=200 if relay.connected else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if state.redis is not None and state.fleet is not None:
            try:  # the fleet-wide queue gauges; without Redis the gateway's own metrics still render
                await metrics.refresh_fleet(state.redis, keys, cfg.tier_names, dict(state.fleet.roles))
            except (RedisError, OSError) as exc:
                log.warning("metrics: cannot read the queues: %s", exc)
        return Response(metrics.render(), media_type=metrics.content_type)

    add_timeline_route(app, cfg, keys, lambda: state.redis)
    add_dashboard_routes(app, cfg, keys, lambda: (state.redis, state.fleet))

    return app


def _failed_error(f: messages.Failed) -> ApiError:
    """A worker's Failed frame as an HTTP error (a nonsense status becomes 500)."""
    status = f.status if 400 <= f.status <= 599 else 500
    return ApiError(status, f.message, type=f.type, code=f.code)
