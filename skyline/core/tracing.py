"""OpenTelemetry traces of each request across the fleet's processes (`--otlp-traces-endpoint`, vLLM's flag).

One trace per request. The gateway's span is its root (named and attributed after OpenTelemetry's
GenAI semantic conventions: `chat MODEL`, `gen_ai.*`), a child of the client's `traceparent` when
it sent one. The request carries the root's context (W3C trace context, `GenerateRequest.trace`)
through Redis to every worker that claims it, and each worker's spans are its children:

    chat MODEL                     gateway: arrival to the response's end (events: admitted, enqueued, placed)
      skyline.queue                the wait in a stream (from the entry's age at the claim)
      skyline.worker               one worker's stay: claim to hand-off or end (events: decode_placed, first_token, ...)
        skyline.prefill.compute    the prompt computed there
        skyline.kv_transfer        the prompt's KV pulled from the engine that computed it
        llm_request                vLLM's own span, from engines started with the same endpoint

The spans are made from the timeline's events (skyline/core/timeline.py `Timeline.emit`: the call
that already logs, counts and stores each event), with the events' own times, so no emit site has
tracing code; what is not an event (the root's start and end, a claimed request's context) is said
here by the gateway's and the workers' observers.

Exporting is vLLM's (`vllm.tracing.init_tracer`: OTLP over gRPC, or over HTTP with
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`), through a batch span processor: spans leave in
the background, and a collector that is down costs no request anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("skyline.tracing")

# A process keeps the context of at most this many requests (those it holds, or whose events it has
# not seen end): past it, the oldest is forgotten (its later events make no spans), never unbounded.
MAX_TRACKED = 10_000

# Events that end a worker's stay with a request (the request left it: handed on, done, given back).
STAY_ENDS = frozenset({"kv_handle_published", "finished", "failed", "cancelled", "requeued", "worker_gave_up"})
# Events a worker's stay records as span events (with their fields as attributes).
STAY_EVENTS = frozenset({"decode_placed", "first_token", "pd_fallback", "migrated", "preempted", "kv_released",
                         "reclaimed"})
# Events the gateway's root span records as span events.
ROOT_EVENTS = frozenset({"admitted", "enqueued", "placed", "cancelled"})


def setup(endpoint: str, service: str, attributes: Mapping[str, str] | None = None,
          engine_sets_provider: bool = False) -> Any:
    """The process's OpenTelemetry tracer, exporting to `endpoint`; None when `endpoint` is empty.
    The provider is vLLM's (`init_tracer`), or the one already set in this process; with
    `engine_sets_provider` (a vLLM engine in this process, started with the same endpoint, sets it when
    it starts: OpenTelemetry keeps the first provider set), OpenTelemetry's proxy tracer, which sends
    through that provider once it is set. `service`: the `service.name` resource, unless
    OTEL_SERVICE_NAME says otherwise."""
    if not endpoint:
        return None
    from opentelemetry import trace

    os.environ.setdefault("OTEL_SERVICE_NAME", service)
    if not engine_sets_provider and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        from vllm.tracing import init_tracer

        init_tracer("skyline", endpoint, dict(attributes or {}))
    return trace.get_tracer("skyline")


@contextlib.contextmanager
def job_span(endpoint: str, name: str, attributes: Mapping[str, Any]) -> Iterator[tuple[Any, dict[str, str]]]:
    """(span, its trace context as headers) of a job that sends requests (a batch's execution), exported
    before this returns (an RQ work horse exits right after its job); (None, {}) without an endpoint."""
    tracer = setup(endpoint, "skyline-batch-runner")
    if tracer is None:
        yield None, {}
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    span = tracer.start_span(name, attributes=_clean(attributes))
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
    try:
        yield span, headers
    except BaseException as exc:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        span.end()
        provider = trace.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush(5_000)


class RequestTraces:
    """One process's spans of the requests it sees (see the module docstring). `tracer`: `setup`'s."""

    def __init__(self, tracer: Any, who: str):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.tracer = tracer
        self.who = who
        self._context: dict[str, Any] = {}  # request id -> the context its spans here are children of
        self._root: dict[str, Any] = {}  # gateway: request id -> its open root span
        self._stay: dict[str, Any] = {}  # worker: request id -> its open stay span
        self._compute: dict[str, Any] = {}  # worker: request id -> its open prompt computation span

    # ---- contexts ---------------------------------------------------------------------------------

    def carrier(self, request_id: str) -> dict[str, str] | None:
        """The W3C trace context of the request's innermost open span here (its stay, else its root), as
        headers: what the request carries to the workers, and what a worker hands its vLLM engine."""
        span = self._stay.get(request_id) or self._root.get(request_id)
        if span is None:
            return None
        headers: dict[str, str] = {}
        self._propagator.inject(headers, context=self._trace.set_span_in_context(span))
        return headers

    def adopt(self, request_id: str, carrier: Mapping[str, str] | None) -> None:
        """A worker claimed the request: its spans here are children of the context it carries (none:
        it was enqueued by a gateway that does not trace, and makes no spans here)."""
        if not carrier:
            return
        self._bound()
        self._context[request_id] = self._propagator.extract(dict(carrier))

    def _bound(self) -> None:
        while len(self._context) >= MAX_TRACKED:
            oldest = next(iter(self._context))
            self._forget(oldest)

    def _forget(self, request_id: str) -> None:
        self._context.pop(request_id, None)
        for spans in (self._compute, self._stay, self._root):
            span = spans.pop(request_id, None)
            if span is not None:
                span.end()

    # ---- the gateway's root span ------------------------------------------------------------------

    def start(self, request_id: str, name: str, t_ms: float, parent: Mapping[str, str] | None,
              attributes: Mapping[str, Any]) -> dict[str, str]:
        """Open the request's root span at its arrival (`t_ms`), a child of the client's trace context
        (`parent`: its headers) when it sent one; returns the context the request carries."""
        from opentelemetry.trace import SpanKind

        self._bound()
        context = self._propagator.extract(dict(parent)) if parent else None
        span = self.tracer.start_span(name, context=context, kind=SpanKind.SERVER, start_time=_ns(t_ms),
                                      attributes=_clean(attributes))
        self._root[request_id] = span
        self._context[request_id] = self._trace.set_span_in_context(span)
        return self.carrier(request_id) or {}

    def end(self, request_id: str, t_ms: float, attributes: Mapping[str, Any], error: str | None = None) -> None:
        """Close the request's root span at `t_ms` (`error`: what the client was told, when it failed)."""
        span = self._root.pop(request_id, None)
        self._context.pop(request_id, None)
        if span is None:
            return
        span.set_attributes(_clean(attributes))
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(t_ms))

    # ---- spans from the timeline's events ---------------------------------------------------------

    def on_event(self, request_id: str, event: str, t_ms: float, fields: Mapping[str, Any]) -> None:
        """`Timeline.emit`'s hook: the spans and span events `event` (at `t_ms`) makes in this process."""
        context = self._context.get(request_id)
        if context is None:
            return
        t = _ns(t_ms)
        if event in ("prefill_claimed", "decode_claimed"):
            stage = event.split("_")[0]
            attrs = {"skyline.stage": stage, "skyline.tier": fields.get("tier"), "skyline.worker.id": self.who}
            self._closed("skyline.queue", context, t - _ns(max(0.0, float(fields.get("wait_ms") or 0))), t, attrs)
            if (old := self._stay.pop(request_id, None)) is not None:
                old.end(end_time=t)
            self._stay[request_id] = self.tracer.start_span(
                "skyline.worker", context=context, start_time=t,
                attributes=_clean({**attrs, "skyline.preemptions": fields.get("preemptions")}))
            return
        stay = self._stay.get(request_id)
        if stay is not None:
            self._on_stay_event(request_id, stay, event, t, fields)
        elif (root := self._root.get(request_id)) is not None and event in ROOT_EVENTS:
            root.add_event(event, _clean(fields), timestamp=t)

    def _on_stay_event(self, request_id: str, stay: Any, event: str, t: int, fields: Mapping[str, Any]) -> None:
        inside = self._trace.set_span_in_context(stay)
        if event == "prefill_started":
            self._compute[request_id] = self.tracer.start_span(
                "skyline.prefill.compute", context=inside, start_time=t,
                attributes=_clean({"gen_ai.usage.input_tokens": fields.get("prompt_tokens")}))
        elif event == "prefill_finished":
            if (span := self._compute.pop(request_id, None)) is not None:
                span.set_attributes(_clean({"skyline.cached_tokens": fields.get("cached_tokens")}))
                span.end(end_time=t)
        elif event == "kv_transfer":
            self._closed("skyline.kv_transfer", inside, t - _ns(float(fields.get("ms") or 0)), t,
                         {"skyline.kv.tokens": fields.get("tokens"), "skyline.kv.bytes": fields.get("bytes")})
        elif event in STAY_EVENTS:
            stay.add_event(event, _clean(fields), timestamp=t)
        if event in STAY_ENDS:
            if (span := self._compute.pop(request_id, None)) is not None:
                span.end(end_time=t)
            self._stay.pop(request_id, None)
            self._context.pop(request_id, None)
            stay.set_attributes(_clean({"skyline.left": event, "skyline.reason": fields.get("reason"),
                                        "gen_ai.usage.output_tokens": fields.get("completion_tokens")}))
            if event == "failed":
                from opentelemetry.trace import Status, StatusCode

                stay.set_status(Status(StatusCode.ERROR, str(fields.get("reason") or "failed")))
            stay.end(end_time=t)

    def _closed(self, name: str, context: Any, start: int, end: int, attributes: Mapping[str, Any]) -> None:
        span = self.tracer.start_span(name, context=context, start_time=start, attributes=_clean(attributes))
        span.end(end_time=max(start, end))


def _ns(t_ms: float) -> int:
    return int(t_ms * 1_000_000)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry takes str, bool, int, float and sequences of one of them: None is left out, the rest as text."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if isinstance(v, (str, bool, int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v):
            out[k] = tuple(v)
        else:
            out[k] = str(v)
    return out
