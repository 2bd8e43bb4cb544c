"""The gateway's FastAPI app: vLLM's OpenAI server in front of the Redis fleet.

Request path of a generation route (each step can refuse with an OpenAI error
before the next runs, so a refused request never reaches a queue):
auth -> rate limit -> token budget (a key in debt) -> body size -> JSON ->
Skyline's `slo` extension -> vLLM's request model (its 400s) -> vLLM's serving
code (rendering, tools, sampling parameters, its 400s) -> FleetClient.generate
per prompt (vLLM's engine-side checks, SLO and the tenant's tiers, route, the
token budget on the prompt's tokens, live workers, admission, subscribe, enqueue)
-> the fleet's frames as vLLM outputs -> vLLM's response or SSE chunks, with
Skyline's `skyline` extension added -> unsubscribe.
Abandoned requests (client gone, timeout) are cancelled in the fleet.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline.core import engine_args, frontend_args, redisconn
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys, keyspace_of
from skyline.core.sim_model import sim_model_dir
from skyline.core.stopping import bounded_step
from skyline.core.streams import ensure_groups, now_ms
from skyline.gateway.adapters import FleetAdapters
from skyline.gateway.batch_routes import batch_router
from skyline.gateway.dashboard import add_dashboard_routes
from skyline.gateway.dispatch import Dispatcher
from skyline.gateway.errors import ApiError, HeaderLimit, from_vllm, install_handlers, vllm_wrote
from skyline.gateway.fleet_client import CLIENT_CLOSED, SCOPE, RequestScope, fleet_client_class
from skyline.gateway.fleetview import FleetView
from skyline.gateway.models import ModelPool, ModelRegistry, ModelSpec
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.observe import GatewayObserver, add_timeline_route
from skyline.gateway.openai_api import Frontend, build_frontend
from skyline.gateway.prepare import Serving, json_body, pop_slo, read_body
from skyline.gateway.ratelimit import KeyRateLimiter, TokenBudgets
from skyline.gateway.relay import Relay
from skyline.gateway.responses_api import ResponsesApi
from skyline.gateway.tenants import Tenant, Tenants, api_key_of, check_model
from skyline.gateway import unserved
from skyline.gateway.vllm_serving_internals import (
    add_server_middleware, allow_vllm_handlers, anthropic_error_body, is_error_response, request_model,
    validation_response,
)
from skyline.scheduler.admission import TtftCalibration
from skyline.scheduler.rate_limit import RateLimit

log = logging.getLogger("skyline.gateway")


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def skyline_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("skyline-serve")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"

# vllm serve's /invocations takes a LoRA adapter's name from this header (SageMaker's), in place of the body's model.
SAGEMAKER_ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"

DONE = "data: [DONE]\n\n"


def create_app(cfg: SkylineConfig, model_path: str, served_model: str, max_model_len: int) -> FastAPI:
    """The gateway app for the model at `model_path` (its config and tokenizer; no weights).
    Its lifespan connects Redis (`cfg.redis.url`), creates the consumer groups, starts the
    token relay and the worker-role cache; shutting down closes them."""
    keys = Keys(cfg.key_prefix)  # the fleet's keys; a model's queues: keys.for_model (skyline/core/keys.py)
    metrics = GatewayMetrics()
    observer = GatewayObserver(cfg, metrics, keys)  # timeline events, SLO verdicts, the rolling SLO record
    budgets = TokenBudgets()  # tenants' token budgets: one per tenant, whichever model it asks
    background: set[asyncio.Task] = set()  # cancel publishes in flight, of every model's requests
    fleet_client = fleet_client_class()

    def build_pool(spec: ModelSpec, own: bool = False) -> ModelPool:
        """One model's serving objects and dispatcher (gateway/models.py); blocking (tokenizer, template).
        A pool built after start-up shares the gateway's Redis client and relay at once (its view of the
        fleet: ModelRegistry); the gateway's own gets them when its lifespan opens them."""
        calibration = TtftCalibration() if cfg.gateway.ttft_calibration else None  # each model's own speed
        d = Dispatcher(cfg, Serving(cfg, spec.name), keys.for_model(spec.keyspace), metrics, observer, calibration,
                       background=background, budgets=budgets)
        if not own:
            d.redis, d.relay = registry.own.dispatcher.redis, registry.own.dispatcher.relay
        front = build_frontend(cfg, fleet_client, d, spec.path or str(sim_model_dir()), spec.name, spec.max_model_len,
                               engine_args=own_engine_args if own else {})
        return ModelPool(spec, front, d, own=own)

    # The vLLM engine arguments the gateway was given (`skyline up` passes every engine's): requests for its
    # own model are checked as those engines check them (--max-logprobs, ...). Other models': vLLM's defaults.
    own_engine_args = engine_args.resolve(cfg.engine, None)[1] if cfg.engine.kind == "vllm" and cfg.engine.vllm else {}

    own = build_pool(ModelSpec(served_model, model_path, max_model_len, keyspace_of(served_model, cfg.default_model)),
                     own=True)
    dispatcher, front = own.dispatcher, own.front
    registry = ModelRegistry(own, build_pool, max_model_len)
    rate_limiter = KeyRateLimiter(RateLimit(cfg.gateway.rate_limit_rps, cfg.gateway.rate_limit_burst))
    tenants = Tenants(cfg.gateway)  # who is asking, and what they may see (gateway/tenants.py)
    # The fleet's LoRA adapters (gateway/adapters.py): every pool's serving models kept in step with Redis.
    lora = FleetAdapters(keys, registry, lambda: dispatcher.redis)
    fleet_client.adapters = lora  # vLLM's load_lora_adapter calls its engine client's add_lora

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # A blocking pool: a burst of requests beyond its connections waits (briefly) for one
        # instead of failing with "Too many connections".
        r = redisconn.connect(cfg.redis, max_connections=64, blocking_timeout_s=5)
        try:
            await ensure_groups(r, keys, cfg.tier_names)
            relay = Relay(cfg.redis, keys)
            await relay.start()
            fleet = FleetView(r, keys, cfg.gateway.worker_liveness_s)
            dispatcher.redis, dispatcher.relay = r, relay
            registry.attach(fleet)
            await fleet.start()
            await registry.learn_now()  # every live model's pool before the first request
            await lora.sync()  # every adapter too
            lora.start()
        except BaseException:
            await r.aclose()
            raise
        observer.start(r)
        log.info("gateway serving %s (max_model_len %d, mode %s) with Redis at %s",
                 ", ".join(repr(p.name) for p in registry.listed()), max_model_len, cfg.gateway.mode,
                 redisconn.describe(cfg.redis))
        # What vllm serve does at start-up too: the start-up heap (vLLM, torch, the tokenizer) is
        # moved out of the collector's sight, so full collections no longer pause requests to walk it.
        gc.freeze()
        try:
            yield
        finally:
            # Every step of the way out is bounded, as a worker's is: a gateway that hangs here is
            # killed by whoever stops it, without a word on where.
            await bounded_step("the background responses", responses_api.close(), log)
            await bounded_step("the adapter registry", lora.close(), log)
            await bounded_step("the fleet view", fleet.close(), log)
            await bounded_step("the model builds", registry.close(), log)
            await bounded_step("the timeline", observer.close(), log)
            await bounded_step("the token relay", relay.close(), log)
            if dispatcher.background:  # let pending cancels reach Redis
                await asyncio.wait(dispatcher.background, timeout=2.0)
            await bounded_step("the Redis client", r.aclose(), log)

    app = FastAPI(title="Skyline gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    allow_vllm_handlers(app)  # what vLLM's validation error handler reads
    install_handlers(app)
    app.add_middleware(HeaderLimit, max_bytes=cfg.gateway.max_header_bytes)
    # vllm serve's HTTP middleware its flags ask for (CORS, X-Request-Id, --middleware), vLLM's own classes.
    add_server_middleware(app, frontend_args.namespace(cfg.gateway.vllm_args))
    app.include_router(batch_router(cfg, lambda: dispatcher.redis, tenants))  # the Batch API (gateway/batch_routes.py)
    generation = _GenerationRoutes(cfg, registry, rate_limiter, budgets, metrics, tenants)
    # The Responses API's store in Redis around vLLM's own Responses serving (gateway/responses_api.py).
    responses_api = ResponsesApi(cfg, tenants, rate_limiter, lambda: dispatcher.redis)

    async def serve_chat(request: Request, body: dict[str, Any] | None = None) -> Response:
        return await generation.serve(request, "chat", request_model("chat"), lambda f: f.chat.create_chat_completion,
                                      body)

    async def serve_completion(request: Request, body: dict[str, Any] | None = None) -> Response:
        return await generation.serve(request, "completion", request_model("completion"),
                                      lambda f: f.completion.create_completion, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_chat(request)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        # vllm serve's SageMaker route: the body is served as the first request model it validates
        # as, in vLLM's order (chat, then completion); the adapter header names the body's model.
        body = await generation.read(request)
        if adapter := request.headers.get(SAGEMAKER_ADAPTER_HEADER):
            body["model"] = adapter
        for kind in ("chat", "completion"):
            if _claims(request_model(kind), body):
                return await (serve_chat if kind == "chat" else serve_completion)(request, body)
        raise ApiError(400, "Cannot find suitable handler for request. Expected one of: "
                            "['ChatCompletionRequest', 'CompletionRequest']", type="BadRequestError", code=400)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Response:
        # vllm serve's Anthropic Messages API: vLLM's own conversion to a chat request and back; errors in
        # that API's shape, as vllm serve answers them.
        try:
            return await generation.serve(request, "messages", request_model("messages"),
                                          lambda f: f.messages.create_messages)
        except ApiError as exc:
            return _anthropic_error(exc)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> Response:
        try:
            return await generation.plain(request, request_model("count_tokens"), lambda f: f.messages.count_tokens,
                                          anthropic=True)
        except ApiError as exc:
            return _anthropic_error(exc)

    # vllm serve's other generation routes, each one call of vLLM's serving code whose engine requests are
    # Skyline requests: path -> (kind, its request model, the call).
    other_routes: dict[str, tuple[str, str, Callable[[Frontend], Callable[..., Awaitable[Any]]]]] = {
        # batched chat: several conversations, one choice and one fleet request each
        "/v1/chat/completions/batch": ("chat", "chat_batch", lambda f: f.chat_batch.create_batch_chat_completion),
        # generative scoring: one one-token read per item
        "/generative_scoring": ("scoring", "generative_scoring", lambda f: f.scoring.create_generative_scoring),
        # structured decisions (label reads), for the architectures vLLM has a read strategy for; any other
        # model gets vllm serve's 501, once the body validated
        "/v1/systemone": ("decision", "decision",
                          lambda f: f.decisions.create_decision if f.decisions else _no_decisions),
    }
    for path, (kind, model_kind, pick) in other_routes.items():
        app.add_api_route(path, generation.route(kind, model_kind, pick), methods=["POST"])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_completion(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        # The model the request names serves it: its serving objects, its workers (gateway/responses_api.py).
        return await generation.serve(request, "responses", request_model("responses"), responses_api.for_model)

    responses_api.add_routes(app)  # GET, cancel, DELETE, input_items of stored responses
    lora.add_routes(app, tenants)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await generation.plain(request, request_model("tokenize"), lambda f: f.tokenization.create_tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await generation.plain(request, request_model("detokenize"),
                                      lambda f: f.tokenization.create_detokenize)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        tenant = tenants.authenticate(request)
        # Each model's own listing by vLLM (its card, its adapters with their parent), one list; a
        # tenant limited to named models sees those only (gateway/tenants.py).
        listing = await front.models.show_available_models()
        listing.data = [card for pool in registry.listed()
                        for card in (await pool.front.models.show_available_models()).data
                        if tenant.may_use(card.id)]
        return JSONResponse(listing.model_dump())

    @app.get("/health")
    @app.get("/ping")  # vllm serve's SageMaker health route
    @app.post("/ping")
    async def health() -> JSONResponse:
        r, fleet, relay = dispatcher.redis, registry.fleet, dispatcher.relay
        try:
            assert r is not None and fleet is not None and relay is not None
            async with asyncio.timeout(1.0):
                await r.ping()
        except (RedisError, OSError, TimeoutError, AssertionError) as exc:
            return JSONResponse({"status": "unavailable", "error": f"Redis does not answer: {exc}"}, status_code=503)
        models = {p.name: dict(p.view.roles) for p in registry.listed() if p.view is not None}
        body = {"status": "ok" if relay.connected else "degraded", "workers": dict(fleet.roles), "models": models,
                "relay_connected": relay.connected, "in_flight": relay.in_flight}
        return JSONResponse(body, status_code=200 if relay.connected else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        # vllm serve's answer (the vLLM its serving code is), and the fleet's layer on it.
        return JSONResponse({"version": vllm_version(), "skyline": skyline_version()})

    @app.get("/load")
    async def load() -> JSONResponse:
        # vllm serve's in-flight request count: here, the requests this gateway relays.
        relay = dispatcher.relay
        return JSONResponse({"server_load": relay.in_flight if relay is not None else 0})

    unserved.add_routes(app)  # vllm serve's other routes: 501 and why (gateway/unserved.py)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if dispatcher.redis is not None and registry.fleet is not None:
            try:  # each model's queue gauges; without Redis the gateway's own metrics still render
                await metrics.refresh_fleet(dispatcher.redis, _model_gauges(registry), cfg.tier_names)
            except (RedisError, OSError) as exc:
                log.warning("metrics: cannot read the queues: %s", exc)
        return Response(metrics.render(), media_type=metrics.content_type)

    add_timeline_route(app, cfg, keys, lambda: dispatcher.redis, tenants)
    add_dashboard_routes(app, cfg, keys, lambda: (dispatcher.redis, registry.fleet), tenants)

    return app


def _model_gauges(registry: ModelRegistry) -> list[tuple[str, Keys, dict[str, int]]]:
    """Each model the gateway has served (one whose workers left too: its gauges go to its queues' and
    0 workers, not stale values): (served name, its queues' keys, its live workers by role)."""
    return [(p.name, p.dispatcher.keys, dict(p.view.roles) if p.view is not None else {})
            for p in registry.by_name.values()]


class _GenerationRoutes:
    """What every generation route does around vLLM's serving call."""

    def __init__(self, cfg: SkylineConfig, registry: ModelRegistry, rate_limiter: KeyRateLimiter,
                 budgets: TokenBudgets, metrics: GatewayMetrics, tenants: Tenants):
        self.cfg = cfg
        self.tenants = tenants
        self.registry = registry
        self.rate_limiter = rate_limiter
        self.budgets = budgets
        self.metrics = metrics

    def route(self, kind: str, model_kind: str, pick: Callable[[Frontend], Callable[..., Awaitable[Any]]]
              ) -> Callable[[Request], Awaitable[Response]]:
        """A route that serves each request with `pick`'s call (`serve`)."""
        async def serve(request: Request) -> Response:
            return await self.serve(request, kind, request_model(model_kind), pick)
        return serve

    async def read(self, request: Request) -> dict[str, Any]:
        """A generation request's body, read once by a route that looks at it before serving it."""
        try:
            return await self._body(request)
        except ApiError as exc:
            self.metrics.count("", "", exc.status)
            raise

    async def _body(self, request: Request, generates: bool = True) -> dict[str, Any]:
        # Tenant and operator keys alike; the tenant is remembered for the timeline's owner and its limits.
        tenant = self.tenants.authenticate(request)
        self.rate_limiter.check(api_key_of(request))  # before any work: a flooding tenant costs the least
        if generates:  # a key in debt: refused before its body is read and rendered
            self.budgets.check(tenant.owner, tenant.tokens_per_minute)
        return json_body(await read_body(request, self.cfg.gateway.max_body_bytes))

    async def _front(self, body: dict[str, Any], tenant: Tenant) -> Frontend:
        """The serving objects of the model the body names (gateway/models.py). A name no model of the
        fleet ever had goes to the gateway's own model's, whose vLLM code answers it with its 404; one
        the tenant may not use gets the same 404 (gateway/tenants.py)."""
        name = body.get("model")
        check_model(tenant, name if isinstance(name, str) and name else self.registry.own.name)
        pool = await self.registry.find(name if isinstance(name, str) else None)
        if pool is None and isinstance(name, str) and name in self.registry.failed:
            raise ApiError(503, f"the gateway cannot serve model {name!r} that its workers serve: "
                                f"{self.registry.failed[name]}", param="model", code="model_unavailable")
        return (pool or self.registry.own).front

    async def plain(self, request: Request, model: Any, pick: Callable[[Frontend], Callable[..., Awaitable[Any]]],
                    anthropic: bool = False) -> Response:
        """A route that never reaches the fleet (tokenize, detokenize, the Messages API's token count): no
        token budget to spend. `anthropic`: answered in the Messages API's shape."""
        body = await self._body(request, generates=False)
        handler = pick(await self._front(body, request.state.tenant))
        try:
            req = _validate(model, body)
        except ValidationError as exc:
            return await _validation_response(request, exc)
        except Exception as exc:  # noqa: BLE001 - vLLM's model validators raise their own errors directly
            raise _refused_body(exc) from None
        try:
            result = await handler(req, request)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - as vLLM's server answers what its serving code raises
            # (a chat template rendering /tokenize's messages can fail as it does for a chat request)
            raise from_vllm(exc) from None
        return _plain_response(result, anthropic)

    async def serve(self, request: Request, kind: str, model: Any,
                    pick: Callable[[Frontend], Callable[..., Awaitable[Any]]],
                    body: dict[str, Any] | None = None) -> Response:
        """`body`: already read (`read`), by a route that chose the kind from it."""
        t_arrival, arrival_ms = time.perf_counter(), now_ms()
        try:
            if body is None:
                body = await self._body(request)
            spec = pop_slo(body)
            handler = pick(await self._front(body, request.state.tenant))
        except ApiError as exc:
            self.metrics.count("", "", exc.status)
            raise
        try:
            req = _validate(model, body)
        except ValidationError as exc:
            self.metrics.count("", "", 400)
            return await _validation_response(request, exc)
        except Exception as exc:  # noqa: BLE001 - vLLM's model validators raise their own errors directly
            self.metrics.count("", "", 400)
            raise _refused_body(exc) from None
        stream = bool(getattr(req, "stream", False))
        options = getattr(req, "stream_options", None)
        scope = RequestScope(request, kind, spec, arrival_ms, t_arrival, stream,
                             bool(stream and options is not None and getattr(options, "include_usage", False)),
                             "request_id" in body or "x-request-id" in request.headers, _prompts(body))
        token = SCOPE.set(scope)
        try:
            try:
                result = await handler(req, request)
            except ApiError:
                raise
            except asyncio.CancelledError:
                scope.close_all(CLIENT_CLOSED)
                raise
            except Exception as exc:  # noqa: BLE001 - as vLLM's server answers what its serving code raises
                scope.close_all(500)
                # from_vllm logs an internal failure under the request's id (a new one when it failed
                # before reaching the fleet, e.g. in the chat template), the id its answer names.
                err = scope.error or from_vllm(exc, scope.preps[0].request.request_id if scope.preps else None)
                raise err from None
            if not stream or not hasattr(result, "__anext__"):
                return self._once(scope, result)
            return await self._stream(scope, result)
        except ApiError as exc:
            scope.close_all(exc.status)
            if not scope.counted:
                self.metrics.count("", "", exc.status)
            if scope.preps:  # the error's own headers win: an internal error's id is the one its message names
                exc.headers = {**_headers(scope), **(exc.headers or {})}
            raise
        finally:
            SCOPE.reset(token)

    def _once(self, scope: RequestScope, result: Any) -> Response:
        if is_error_response(result):
            if scope.error is not None:
                raise scope.error
            if scope.client_gone:
                return Response(status_code=CLIENT_CLOSED)
            if not scope.counted:
                self.metrics.count("", "", result.error.code)
            return _error_json(result, anthropic=scope.kind == "messages")
        # vllm serve leaves a Messages API answer's unset fields out
        body = result.model_dump(exclude_none=scope.kind == "messages")
        ext = _skyline(scope)
        if ext is not None:
            body["skyline"] = ext
        return JSONResponse(body, headers=_headers(scope))

    async def _stream(self, scope: RequestScope, chunks: Any) -> Response:
        """Wait for the first chunk before committing to 200, so that a request that fails
        before producing anything still gets a real HTTP error status."""
        try:
            first = await chunks.__anext__()
            # vLLM's Responses stream sends its opening events before it starts the request: they wait
            # here until the fleet took it, so a request it refuses still gets its HTTP status.
            while scope.kind == "responses" and first.startswith(_RESPONSE_OPENING):
                scope.opening.append(first)
                first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except asyncio.CancelledError:
            if not scope.client_gone:
                raise
            scope.close_all(CLIENT_CLOSED)  # the client left before the first chunk: nothing to send
            return Response(status_code=CLIENT_CLOSED)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM's Responses stream passes generate()'s errors on raw
            scope.close_all(500)
            raise scope.error or from_vllm(exc, scope.preps[0].request.request_id if scope.preps else None) from None
        if scope.error is not None and not scope.started:
            await chunks.aclose()
            raise scope.error
        return StreamingResponse(_sse(scope, first, chunks), media_type="text/event-stream",
                                 headers={**_headers(scope), "cache-control": "no-cache", "x-accel-buffering": "no"})


async def _sse(scope: RequestScope, first: str | None, chunks: Any) -> AsyncIterator[bytes]:
    """vLLM's chunks as they come. The last one before [DONE] gets the `skyline` extension, so a chunk
    that may be the last (it closes a choice or carries the usage) waits for the next one; content
    chunks (`"finish_reason":null`) are never held back. A Responses stream (events, no [DONE]) passes
    through as it is."""
    # The request's scope, again: the response is iterated after `serve` returned (in a task of
    # Starlette's, with a copy of the context as it was then), and vLLM's Responses stream starts the
    # fleet request only after its first events (`FleetClient.generate` reads the scope).
    SCOPE.set(scope)
    held: str | None = None
    hold = scope.kind not in ("responses", "messages")  # event streams without [DONE]
    status = CLIENT_CLOSED
    try:
        pending = scope.opening + ([first] if first is not None else [])
        async for chunk in _chain(pending, chunks, scope):
            if held is not None:
                yield (_with_skyline(held, scope) if chunk == DONE else held).encode()
                held = None
            if hold and chunk != DONE and '"finish_reason":null' not in chunk:
                held = chunk
            else:
                yield chunk.encode()
        if held is not None:
            yield held.encode()
        status = 200
    finally:
        scope.close_all(status)  # sessions still open here were abandoned (client gone mid-stream)


async def _chain(head: list[str], rest: Any, scope: RequestScope) -> AsyncIterator[str]:
    for chunk in head:
        yield chunk
    try:
        async for chunk in rest:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - answered below
        if scope.kind != "responses":
            raise
        # A Responses stream has no error chunk of vLLM's own: its failure event, as the API defines it
        # (a chat or completion stream's failure is vLLM's error chunk, written by its serving code).
        err = exc if isinstance(exc, ApiError) else from_vllm(exc, scope.preps[0].request.request_id
                                                             if scope.preps else None)
        yield "event: error\ndata: " + json.dumps({"type": "error", "code": err.code, "message": err.message,
                                                   "param": err.param, "sequence_number": -1}) + "\n\n"


_RESPONSE_OPENING = ("event: response.created\n", "event: response.in_progress\n")


def _with_skyline(chunk: str, scope: RequestScope) -> str:
    ext = _skyline(scope)
    if ext is None or not chunk.startswith("data: {"):
        return chunk
    try:
        obj = json.loads(chunk[len("data: "):])
    except ValueError:
        return chunk
    if "error" in obj:
        return chunk
    obj["skyline"] = ext
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _skyline(scope: RequestScope) -> dict[str, Any] | list[dict[str, Any]] | None:
    """How the request was served: one object, or one per prompt of a batched completion."""
    done = [s.skyline(fin) for s, fin in scope.finals]
    if not done:
        return None
    return done[0] if len(done) == 1 else done


def _prompts(body: dict[str, Any]) -> int:
    """How many prompts a request carries: a completion's list of strings or of token-id lists, the
    batched chat's list of conversations, generative scoring's items."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    items = body.get("items")  # generative scoring: one read per item
    if isinstance(items, list) and items:
        return len(items)
    conversations = body.get("messages")
    if isinstance(conversations, list) and conversations and all(isinstance(c, list) for c in conversations):
        return len(conversations)
    return 1


async def _no_decisions(request: Any, raw_request: Any) -> Any:
    raise ApiError(501, "The model does not support the structured decision API", type="NotImplementedError",
                   code=501)


def _claims(model: type, body: dict[str, Any]) -> bool:
    """Whether vLLM's /invocations hands `body` to `model`'s route: it validates, or a validator of the
    model raised vLLM's own error, which that route answers (only pydantic's failure tries the next)."""
    try:
        _validate(model, body)
    except ValidationError:
        return False
    except Exception:  # noqa: BLE001 - answered by the route, as vLLM's exception handler answers it
        return True
    return True


def _headers(scope: RequestScope) -> dict[str, str]:
    if not scope.preps:
        return {}
    prep = scope.preps[0]
    return {"x-skyline-request-id": prep.request.request_id, "x-skyline-tier": prep.slo.tier,
            "x-skyline-route": prep.route}


def _refused_body(exc: Exception) -> ApiError:
    """A body vLLM's request models could not validate. Their validators raise vLLM's own errors (400s,
    answered as vLLM answers them), and some fail on a field of an unexpected shape (vLLM 0.32:
    `"structured_outputs": "hi"` raises AttributeError, a 500 in vllm serve): the body is the client's,
    so that is a 400 too, without the exception's text."""
    if vllm_wrote(exc):
        err = from_vllm(exc)
        if err.status < 500:
            return err
    log.info("request body refused by vLLM's request model validators: %r", exc)
    return ApiError(400, "the request body does not validate: a field has an unexpected type or shape",
                    code="invalid_request_body")


def _validate(model: Any, body: dict[str, Any]) -> Any:
    if isinstance(model, type):
        return model.model_validate(body)
    from pydantic import TypeAdapter  # a union of request models (/tokenize)

    return TypeAdapter(model).validate_python(body)


async def _validation_response(request: Request, exc: ValidationError) -> Response:
    """vLLM's answer to a body its request models refuse (as FastAPI hands them to it)."""
    from fastapi.exceptions import RequestValidationError

    errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
    return await validation_response(request, RequestValidationError(errors))


def _plain_response(result: Any, anthropic: bool = False) -> Response:
    if is_error_response(result):
        return _error_json(result, anthropic)
    return JSONResponse(result.model_dump(exclude_none=anthropic))


def _error_json(result: Any, anthropic: bool) -> JSONResponse:
    """vLLM's error answer, in the Messages API's shape on its routes (as vllm serve translates it)."""
    info = result.error
    body = anthropic_error_body(info.type, info.message) if anthropic else result.model_dump()
    return JSONResponse(body, status_code=info.code)


def _anthropic_error(exc: ApiError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(exc.type, exc.message), status_code=exc.status, headers=exc.headers)
