"""`FleetClient`: vLLM's `EngineClient` interface, answered by the Skyline fleet.

vLLM's serving layer (gateway/openai_api.py) renders a request, builds its
`SamplingParams` and calls `engine_client.generate(prompt, params, request_id)`
once per prompt; in `vllm serve` that is the engine. Here `generate` checks the
parameters as vLLM's engine front end would (its `InputProcessor`: the same
400s), gives the request its SLO and route, runs admission control, subscribes
to its token channel, enqueues it (gateway/dispatch.py), and yields the
fleet's frames back as `RequestOutput`s (gateway/outputs.py).

What the serving layer does not pass to `generate` (the HTTP request: SLO
headers, the `slo` body extension, where the client is) comes through a
`RequestScope` the route sets for the duration of the call. The scope also
collects every failure that happens before the first output, so the route can
answer it with its own HTTP status instead of a 200 stream that begins with an
error (vLLM's stream generators turn any exception into an error chunk).

Engine management calls (sleep, profiling, cache resets) are not the gateway's to
make: they raise NotImplementedError, and no route calls them. LoRA's `add_lora` is
the fleet's load of an adapter (gateway/adapters.py); a request whose `model` is an
adapter carries it to the workers (`GenerateRequest.adapter`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from skyline.core import messages
from skyline.gateway.dispatch import Dispatcher
from skyline.gateway.errors import ApiError, from_vllm, vllm_wrote
from skyline.gateway.outputs import OutputAssembler
from skyline.gateway.prepare import Prepared, SloSpec, prepare
from skyline.gateway.session import Disconnected, Session
from skyline.gateway.tenants import ANONYMOUS, tenant_of
from skyline.gateway.vllm_serving_internals import check_inputs, engine_client_class, validation_error

log = logging.getLogger("skyline.gateway")

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; only seen in metrics


@dataclass
class RequestScope:
    """One HTTP request while vLLM's serving code handles it."""

    raw: Request
    kind: str  # "chat", "completion", "responses"
    slo: SloSpec | None
    arrival_ms: int
    t_arrival: float
    stream: bool
    include_usage: bool
    client_request_id: bool  # the client named the request (X-Request-Id, `request_id`): ids need a suffix
    prompts: int = 1  # prompts in the request (a batched completion has several)
    sessions: list[Session] = field(default_factory=list)
    preps: list[Prepared] = field(default_factory=list)
    finals: list[tuple[Session, messages.Finished]] = field(default_factory=list)  # prompts served, in order
    error: ApiError | None = None  # the first failure before any output
    started: bool = False  # some output was handed to the serving layer
    client_gone: bool = False
    opening: list[str] = field(default_factory=list)  # a Responses stream's first events, held until the fleet took it
    counted: bool = False  # a status is in the gateway's request counter (a session, or a refusal at the door)
    # A background response (gateway/responses_api.py): it runs on after its HTTP request was answered,
    # so nothing here watches that connection.
    detached: bool = False

    def close_all(self, status: int) -> None:
        for s in self.sessions:
            s.close(status)


SCOPE: contextvars.ContextVar[RequestScope] = contextvars.ContextVar("skyline_request_scope")


class _ClientGone(asyncio.CancelledError):
    """The client went away while its output was awaited (non-streaming)."""


class FleetClient:
    """Built by `gateway.openai_api.build_frontend`; subclassed from vLLM's EngineClient lazily
    (`fleet_client_class`) so this module imports without vLLM."""

    def __init__(self, vllm_config: Any, renderer: Any, input_processor: Any, dispatcher: Dispatcher):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = input_processor
        self.dispatcher = dispatcher
        self._by_id: dict[str, Session] = {}

    # ---- the interface vLLM's serving layer uses -----------------------------------

    is_running = property(lambda self: True)
    is_stopped = property(lambda self: False)
    errored = property(lambda self: False)
    dead_error = property(lambda self: RuntimeError("the Skyline fleet client does not die"))

    adapters: Any = None  # the fleet's LoRA adapters (gateway/adapters.py FleetAdapters), set by the app

    async def add_lora(self, lora_request: Any) -> bool:
        """vLLM's load_lora_adapter asks its engine to load the adapter: here, the fleet's registry does."""
        if self.adapters is None:
            raise RuntimeError("this gateway serves no LoRA adapters")
        return await self.adapters.add(lora_request)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Admission needs the prompt's length, known only in generate(); it runs there (see the module doc)."""

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *, lora_request: Any = None,
                       priority: int = 0, session_id: str | None = None, kv_hints: Any = None,
                       data_parallel_rank: int | None = None, trace_headers: Any = None,
                       **_parser_state: Any) -> AsyncGenerator[Any, None]:
        # trace_headers: the client's W3C trace context (vLLM's serving layer passes it when the request
        # has one): the parent of this request's trace, when this gateway exports traces (skyline/core/tracing.py).
        # _parser_state (reasoning_ended, reasoning_parser_kwargs): what an engine needs to start a
        # grammar only after the reasoning ends; not carried (see _refuse_engine_extras). The
        # parsers themselves run here, in the gateway.
        scope = SCOPE.get()
        session: Session | None = None
        status, fin = 500, None
        fleet_id: str | None = None  # what an internal error names (a new id until the fleet's is known)
        try:
            self._check(prompt, sampling_params, request_id, lora_request, priority)
            _refuse_engine_extras(prompt, sampling_params, session_id, kv_hints, data_parallel_rank,
                                  _parser_state.get("reasoning_parser_kwargs"))
            ids = list(prompt["prompt_token_ids"])
            fleet_id = _fleet_id(scope, request_id)
            tenant = tenant_of(scope.raw) or ANONYMOUS
            prep = prepare(self.dispatcher.serving, scope.kind, scope.raw, scope.slo, fleet_id, ids,
                           sampling_params, scope.stream, scope.include_usage, scope.arrival_ms, scope.t_arrival,
                           cache_salt=prompt.get("cache_salt"), strictest_tier=tenant.strictest_tier)
            if lora_request is not None:  # the adapter the request's `model` named, as vLLM's serving models resolved it
                prep = replace(prep, request=replace(prep.request, adapter=messages.AdapterRef(
                    lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)))
            # The token budget, in this process: before anything touches Redis (gateway/ratelimit.py).
            spent = self.dispatcher.budgets.admit(tenant.owner, tenant.tokens_per_minute, len(ids))
            prep = self.dispatcher.observer.traced(prep, trace_headers)  # ended by the observer's refused/closed
            try:
                session = await self._submit(scope, prep, request_id)
            except BaseException:
                if spent is not None:
                    spent.refund()  # never queued: it used nothing of the fleet
                raise
            if spent is not None:
                session.on_close.append(spent.settle)  # its output tokens, when it ends
            assembler = OutputAssembler(request_id, prompt.get("prompt"), ids, sampling_params.n,
                                        sampling_params.output_kind,
                                        # logprobs, or only logprob_token_ids: vLLM's count of either
                                        sampling_params.num_logprobs is not None)
            while not assembler.finished:
                # Watch for the client leaving while no response has started (a stream that has started
                # is Starlette's to watch: it cancels the response when the client goes).
                watch = scope.raw if not (scope.detached or (scope.stream and scope.started)) else None
                frames = await session.frames(watch)
                # Tokens that arrived before a failure in the same batch are the client's: send them,
                # then the error (a stream then ends with an error chunk after its text, as it happened).
                failed = next((f for f in frames if isinstance(f, messages.Failed)), None)
                if failed is not None:
                    frames = frames[:frames.index(failed)]
                fin = next((f for f in frames if isinstance(f, messages.Finished)), fin)
                out = assembler.add(frames) if frames else None
                if out is not None:
                    scope.started = True
                    yield out
                if failed is not None:
                    status = failed.status if 400 <= failed.status <= 599 else 500
                    raise ApiError(status, failed.message, type=failed.type, code=failed.code)
            status = 200
            if fin is not None:
                scope.finals.append((session, fin))
        except Disconnected:
            status, scope.client_gone = CLIENT_CLOSED, True
            raise _ClientGone() from None
        except ApiError as exc:
            status = exc.status
            if session is not None:
                session.cancel("timeout" if exc.status in (503, 504) else "gateway_abort")
            if not scope.started and scope.error is None:
                scope.error = exc
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = CLIENT_CLOSED
            raise
        except Exception as exc:
            err = from_vllm(exc, fleet_id)
            if not scope.started and scope.error is None:
                scope.error = err
            if vllm_wrote(exc):
                raise
            # vLLM's serving code makes the client's error out of what generate() raises (a stream's
            # error chunk carries its text): an internal failure goes on as its generic answer.
            raise err from None
        finally:
            if session is not None:
                self._by_id.pop(request_id, None)
                session.close(status, fin)

    def _check(self, prompt: Any, params: Any, request_id: str, lora_request: Any, priority: int) -> None:
        """vLLM's engine-side checks of a request (its InputProcessor), before anything is queued."""
        if priority:
            raise validation_error("`priority` is not taken by Skyline: its SLO tiers order requests; send "
                                   "the `x-slo-tier` header or `slo.tier` instead", parameter="priority",
                                   value=priority)
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise validation_error("Skyline serves token prompts only (no multimodal inputs)", parameter="prompt")
        # The adapter is not checked against a LoRA config here: the gateway runs no engine; vLLM's serving
        # models resolved it from the fleet's registry, and the engine that runs it checks it.
        check_inputs(self.input_processor, request_id, prompt, params)
        # vLLM bounds top_k only in its engine, which takes any top_k at or past the vocabulary as the
        # whole vocabulary (v1 InputBatch). Say so here: a top_k past 64 bits does not encode for the
        # workers, and would be a 500 for a request that means "no top-k".
        params.top_k = min(params.top_k, self.model_config.get_vocab_size())

    async def _submit(self, scope: RequestScope, prep: Prepared, request_id: str) -> Session:
        observer = self.dispatcher.observer
        try:
            session = await self.dispatcher.submit(prep)
        except ApiError as exc:
            scope.counted = True
            if not exc.recorded:
                self.dispatcher.metrics.count(prep.slo.tier, prep.route, exc.status, prep.request.model)
                observer.refused(prep, scope.raw, exc)
            raise
        prep = session.prep  # admission control may have demoted it
        observer.enqueued(prep, scope.raw, session.t_enqueue_ms, session.placement)
        scope.sessions.append(session)  # its close() counts its status
        scope.counted = True
        scope.preps.append(prep)
        self._by_id[request_id] = session  # abort() gets vLLM's id
        return session

    async def abort(self, request_id: Any) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if (s := self._by_id.get(rid)) is not None:
                s.cancel("gateway_abort")

    async def notify_kv_transfer_request_rejected(self, request_id: str, kv_transfer_params: dict, **_: Any) -> None:
        """Skyline never hands client-given KV handles to engines (kv_transfer_params are refused)."""

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        """Fleet statistics are in /metrics and `skyline status`."""

    async def check_health(self) -> None:
        """The gateway's /health checks Redis and the relay."""

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)


def _fleet_id(scope: RequestScope, request_id: str) -> str:
    """The id the request has in the fleet (Redis keys, timelines, `x-skyline-request-id`).

    vLLM's completion serving names the engine request of prompt i `<id>-i`; with one prompt the
    fleet uses the response's own id, so a client finds its request's timeline under the `id` it got.
    A client-chosen id (X-Request-Id, `request_id`) gets a random suffix: ids must be unique in Redis,
    and one client must not reach another's request state by naming it.
    """
    if scope.kind == "completion" and scope.prompts == 1 and request_id.endswith("-0"):
        request_id = request_id[:-2]
    if not scope.client_request_id:
        return request_id
    # The id goes back in a response header: a control character (`"\r\n"`) or one past Latin-1 cannot
    # (uvicorn drops the connection without an answer), so a client-chosen id is held to printable ASCII.
    if not (request_id.isascii() and request_id.isprintable()):
        param = "x-request-id" if "x-request-id" in scope.raw.headers else "request_id"
        raise ApiError(400, f"{param} may hold only printable ASCII characters", param=param,
                       code="invalid_request_id")
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def _refuse_engine_extras(prompt: dict, params: Any, session_id: str | None, kv_hints: Any,
                          data_parallel_rank: int | None, reasoning_parser_kwargs: dict | None = None) -> None:
    """What vLLM's server hands its engine beside the prompt and the sampling, which Skyline does not
    carry to its workers: refused with a 400 rather than accepted and dropped."""
    def refuse(param: str, why: str) -> None:
        raise validation_error(f"`{param}` is not supported by Skyline: {why}", parameter=param)

    extra = params.extra_args or {}
    if extra.get("kv_transfer_params") is not None:
        refuse("kv_transfer_params", "KV handles are made and consumed by its own prefill and decode workers")
    if extra.get("ec_transfer_params") is not None:
        refuse("ec_transfer_params", "encoder caches (multimodal) are not moved between its workers")
    if getattr(params, "routed_experts_prompt_start", None):
        refuse("routed_experts_prompt_start", "routed experts are not carried back from its workers")
    if session_id is not None:
        refuse("session_id", "streaming-input sessions are not carried through the fleet")
    if kv_hints is not None:
        refuse("kv_hints", "placement is Skyline's scheduler's")
    if data_parallel_rank is not None:
        refuse("X-data-parallel-rank", "workers, not data-parallel ranks, serve requests")
    if getattr(params, "thinking_token_budget", None) is not None:
        refuse("thinking_token_budget", "the engine-side reasoning budget is not carried to the workers")
    if reasoning_parser_kwargs is not None and params.structured_outputs is not None:
        # vLLM's engine would apply the grammar only once the reasoning ends; the workers' engines
        # do not know the reasoning parser, so they would constrain the reasoning too.
        refuse("response_format", "structured outputs together with a reasoning parser are not carried "
                                  "to the workers yet")


def _not_for_a_gateway(name: str):
    async def refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is an engine operation; the Skyline gateway runs no engine")

    refuse.__name__ = name
    return refuse


_FLEET_CLIENT_CLASS: type | None = None


def fleet_client_class() -> type:
    """FleetClient as a subclass of vLLM's EngineClient (built once, on first use)."""
    global _FLEET_CLIENT_CLASS
    if _FLEET_CLIENT_CLASS is None:
        _FLEET_CLIENT_CLASS = engine_client_class(FleetClient, "FleetClient", _not_for_a_gateway)
    return _FLEET_CLIENT_CLASS
