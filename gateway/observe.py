"""What the gateway records about each request: timeline events, the SLO verdict, the rolling record.

The gateway sees a request arrive, get admitted (or refused) and enqueued,
and sees the client's side of the end: latencies, status, cancellation. It
records those as timeline events (`skyline.core.timeline`), counts one SLO
verdict per request (`GatewayMetrics.verdict`), and adds the outcome to the
fleet's rolling SLO record in Redis (`skyline.core.slo_record`). The workers
record what happens in between. Everything here is best-effort: a failure
is logged and counted, never raised into a request.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, replace
from typing import Any

from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline.core import messages
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.core.streams import Placement
from skyline.core.slo_record import Outcome, SloRecorder
from skyline.core.timeline import Timeline, now_ms, phase_durations, read_timeline, requester_of
from skyline.core.tracing import RequestTraces
from skyline.core.tracing import setup as setup_tracing
from skyline.gateway.errors import ApiError
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.prepare import Prepared
from skyline.gateway.tenants import Tenants, tenant_of

log = logging.getLogger("skyline.gateway")

# Admission's refusals by error code, as the `admitted` event's decision.
_REFUSAL_DECISION = {"slo_unattainable": "reject", "overloaded": "overloaded"}
# The OpenTelemetry GenAI operation name of each kind of request (gen_ai.operation.name).
_OPERATION = {"chat": "chat", "completion": "text_completion", "responses": "chat", "messages": "chat",
              "scoring": "text_completion", "decision": "chat"}


def gateway_id() -> str:
    return f"gateway-{socket.gethostname()}-{os.getpid()}"


class GatewayObserver:
    def __init__(self, cfg: SkylineConfig, metrics: GatewayMetrics, keys: Keys, who: str | None = None):
        self.cfg = cfg
        self.obs = cfg.observability
        self.metrics = metrics
        self.keys = keys
        self.who = who or gateway_id()
        self.timeline: Timeline | None = None
        self.slo: SloRecorder | None = None
        self.traces: RequestTraces | None = None  # with --otlp-traces-endpoint

    def start(self, r: Any) -> None:
        """Bind to the app's Redis client (at start-up)."""
        o = self.obs
        self.timeline = Timeline(r, self.keys, self.who, o.timeline_ttl_s, o.timeline_max_events,
                                 enabled=o.timeline, log_events=o.log_events)
        self.slo = SloRecorder(self.timeline.batcher, self.keys, o.slo_window_minutes, o.recent_requests)
        tracer = setup_tracing(o.otlp_traces_endpoint, "skyline-gateway", {"skyline.process": self.who})
        if tracer is not None:
            self.traces = self.timeline.traces = RequestTraces(tracer, self.who)
        self.metrics.watch_timeline(lambda: self.timeline.errors if self.timeline else 0)

    async def close(self) -> None:
        if self.timeline is not None:
            await self.timeline.flush()

    # ---- events -------------------------------------------------------------------

    def traced(self, prep: Prepared, client_context: Any) -> Prepared:
        """Before it is enqueued: open the request's root span (a child of the client's trace context,
        `client_context`: its traceparent headers) and let the request carry its context to the workers."""
        if self.traces is None:
            return prep
        req = prep.request
        try:
            carrier = self.traces.start(
                req.request_id, f"{_OPERATION.get(prep.kind, prep.kind)} {req.model}", req.arrival_ms,
                client_context, {"gen_ai.operation.name": _OPERATION.get(prep.kind, prep.kind),
                                 "gen_ai.system": "vllm", "gen_ai.request.model": req.model,
                                 "gen_ai.request.max_tokens": req.sampling.max_tokens,
                                 "gen_ai.request.temperature": req.sampling.temperature,
                                 "gen_ai.request.top_p": req.sampling.top_p,
                                 "gen_ai.response.id": req.request_id,
                                 "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                                 "skyline.tier": req.tier, "skyline.route": prep.route, "skyline.stream": prep.stream,
                                 "skyline.adapter": req.adapter.name if req.adapter else None})
        except Exception:  # noqa: BLE001 - observability must never fail a request
            log.exception("starting the trace of %s failed", req.request_id)
            return prep
        return replace(prep, request=replace(req, trace=carrier))

    def _end_trace(self, request_id: str, attributes: dict[str, Any], error: str | None) -> None:
        if self.traces is None:
            return
        try:
            self.traces.end(request_id, now_ms(), attributes, error)
        except Exception:  # noqa: BLE001 - observability must never fail a request
            log.exception("ending the trace of %s failed", request_id)

    def _arrival(self, prep: Prepared, request: Request) -> None:
        tl, req = self.timeline, prep.request
        assert tl is not None
        tl.emit(req.request_id, "arrived", t_ms=req.arrival_ms, kind=prep.kind, prompt_tokens=len(req.prompt_token_ids),
                max_tokens=req.sampling.max_tokens, stream=prep.stream, route=prep.route)
        tenant = tenant_of(request)
        if tenant is not None and tenant.owner:  # keys on: the timeline is its sender's (gateway/tenants.py)
            tl.set_requester(req.request_id, tenant.owner)

    def enqueued(self, prep: Prepared, request: Request, t_enqueue_ms: int, placement: Placement | None = None) -> None:
        """The request is in its first stream (`t_enqueue_ms`: taken just before the XADD,
        so no worker's claim can look earlier than it), placed for a worker's prefix cache or not."""
        if self.timeline is None:
            return
        req = prep.request
        self._arrival(prep, request)
        if self.cfg.gateway.admission:
            self.timeline.emit(req.request_id, "admitted", t_ms=t_enqueue_ms, decision=prep.admission,
                               tier=req.tier, predicted_ttft_ms=_round(prep.predicted_ttft_ms))
        self.timeline.emit(req.request_id, "enqueued", t_ms=t_enqueue_ms,
                           stage="prefill" if prep.route == "disagg" else "decode", tier=req.tier,
                           deadline_ms=req.deadline_ms)
        if placement is not None:
            self.timeline.emit(req.request_id, "placed", t_ms=t_enqueue_ms, worker=placement.worker,
                               matched_blocks=placement.matched_blocks, wait_ms=placement.until_ms - t_enqueue_ms)

    def refused(self, prep: Prepared | None, request: Request, exc: ApiError) -> None:
        """A request refused after it was parsed (429, 503, ...): it missed its SLO."""
        if prep is None or self.timeline is None:
            return  # refused before it had an id or a tier (401, 400, 413): nothing to trace
        req, tier = prep.request, prep.slo.tier
        self._arrival(prep, request)
        if exc.code in _REFUSAL_DECISION:
            self.timeline.emit(req.request_id, "admitted", decision=_REFUSAL_DECISION[exc.code], tier=tier)
        self.timeline.emit(req.request_id, "failed", status=exc.status, reason=exc.code or exc.type)
        self._end_trace(req.request_id, {"http.response.status_code": exc.status, "skyline.slo_met": False},
                        exc.code or exc.type)
        self.metrics.verdict(tier, False, req.model)
        outcome = Outcome(req.request_id, tier, int(now_ms()), exc.status, False, route=prep.route,
                          prompt_tokens=len(req.prompt_token_ids), model=req.model)
        if self.slo is not None:
            self.slo.add(outcome, in_recent=False)  # refusals are counted, not listed: overload would flood the list

    def closed(self, session: Any, status: int, fin: messages.Finished | None) -> None:
        """Session.close hook: the client's view of the end of the request."""
        try:
            self._closed(session, status, fin)
        except Exception:  # noqa: BLE001 - observability must never fail a request
            log.exception("recording the end of %s failed", session.request_id)

    def _closed(self, session: Any, status: int, fin: messages.Finished | None) -> None:
        tl = self.timeline
        if tl is None:
            return
        prep, rid = session.prep, session.request_id
        tier, slo = prep.slo.tier, prep.slo
        for gap in session.itl_s:
            self.metrics.itl.labels(prep.request.model, tier).observe(gap)
        ttft = tpot = None
        met = False
        if fin is not None:
            ttft, tpot, met = session.latency(fin)
        end = session.t_end if session.t_end is not None else time.perf_counter()
        e2e_ms = (end - prep.t_arrival) * 1000
        if session.cancel_reason:
            tl.emit(rid, "cancelled", reason=session.cancel_reason)
        elif fin is None:
            f = session.failure
            tl.emit(rid, "failed", status=status, reason=(f.code or f.message[:80]) if f else "no_output")
        ttft_ms = None if ttft is None else round(ttft * 1000, 1)
        tpot_ms = None if tpot is None else round(tpot * 1000, 2)
        tl.emit(rid, "responded", status=status, ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=round(e2e_ms, 1),
                slo_met=met)
        error = None if fin is not None else (session.cancel_reason or (
            (session.failure.code or session.failure.message[:80]) if session.failure else "no_output"))
        self._end_trace(rid, {"http.response.status_code": status, "skyline.ttft_ms": ttft_ms,
                              "skyline.tpot_ms": tpot_ms, "skyline.slo_met": met, "skyline.tier": tier,
                              "gen_ai.usage.output_tokens": fin.completion_tokens if fin else None,
                              "gen_ai.response.finish_reasons": (fin.finish_reason,) if fin and fin.finish_reason
                              else None}, error)
        self.metrics.verdict(tier, met, prep.request.model)
        outcome = Outcome(
            rid, tier, int(now_ms()), status if fin is None else 200, met,
            ttft_met=ttft is not None and ttft * 1000 <= slo.ttft_ms,
            ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=round(e2e_ms, 1), route=prep.route,
            prompt_tokens=len(prep.request.prompt_token_ids), completion_tokens=fin.completion_tokens if fin else 0,
            model=prep.request.model)
        if self.slo is not None:
            self.slo.add(outcome)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def add_timeline_route(app: Any, cfg: SkylineConfig, keys: Keys, redis_of: Any, tenants: Tenants) -> None:
    """`GET /v1/requests/{id}/timeline`: the request's events and phase durations.

    With API keys on, it takes a key like every inference route, and a client
    reads only requests it sent (the gateway stored the sending key's owner
    digest); any other id answers 404, whether it exists or not. Operator
    keys read every timeline.
    """
    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str, request: Request) -> JSONResponse:
        tenant = tenants.authenticate(request)
        r = redis_of()
        if r is None:
            raise ApiError(503, "the gateway is not connected to Redis", code="redis_unavailable")
        not_found = ApiError(404, f"no timeline for request {request_id!r}: unknown, expired "
                                  f"(kept {cfg.observability.timeline_ttl_s} s) or not sent with this API key",
                             code="timeline_not_found")
        try:
            if not tenant.sees_all and not tenant.owns(await requester_of(r, keys, request_id)):
                raise not_found
            events = await read_timeline(r, keys, request_id)
        except (RedisError, OSError) as exc:
            raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None
        if not events:
            raise not_found
        return JSONResponse({"object": "request.timeline", "request_id": request_id,
                             "events": [asdict(e) for e in events], "phases": phase_durations(events)})
