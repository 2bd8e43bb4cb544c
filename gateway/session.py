"""One request in flight: waiting for frames, timing them, cancelling on abandonment.

A `Session` starts once the request is subscribed and enqueued and ends with
`close()`. It measures latency the way the client sees it (arrival at the
gateway to the first token, then the mean gap per further token), enforces the
two timeouts, and makes sure a request nobody waits for any more is cancelled
in the fleet: a Cancel on the broadcast channel for workers running it, and a
tombstone key for a worker that claims it from a queue later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline.core import messages
from skyline.core.config import GatewayConfig
from skyline.core.keys import Keys
from skyline.core.streams import Placement
from skyline.gateway.errors import ApiError
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.prepare import Prepared
from skyline.gateway.relay import Relay, Subscription

log = logging.getLogger("skyline.gateway")

TOMBSTONE_TTL_S = 600  # longer than any request may wait in a queue
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class Disconnected(Exception):
    """The client closed the connection before the response was complete."""


class Session:
    def __init__(self, prep: Prepared, sub: Subscription, relay: Relay, r: aioredis.Redis, keys: Keys,
                 gw: GatewayConfig, metrics: GatewayMetrics, background: set[asyncio.Task]):
        self.prep = prep
        self.request_id = prep.request.request_id
        self.sub = sub
        self.relay = relay
        self.r = r
        self.keys = keys
        self.gw = gw
        self.metrics = metrics
        self.background = background
        self.t_first_frame: float | None = None
        self.t_first_token: float | None = None
        self.t_end: float | None = None
        self.tokens = 0
        self.finished = False  # a terminal frame from the fleet arrived: nothing left to cancel
        self.cancelled = False
        self.closed = False
        self.cancel_reason: str | None = None
        self.t_enqueue_ms = 0  # wall clock just before the XADD (the timeline's `enqueued`)
        self.placement: Placement | None = None  # placed for a worker's prefix cache (gateway/affinity.py)
        self.t_enqueued: float | None = None  # perf_counter() once the XADD returned
        self.failure: messages.Failed | None = None  # the error frame, when the request failed
        self.t_last_token: float | None = None
        self.itl_s: list[float] = []  # gaps between frames that carried tokens
        self.on_close: list = []  # callables (session, status, fin), e.g. the timeline and SLO record
        metrics.in_flight.labels(prep.request.model).inc()

    # ---- frames ---------------------------------------------------------------------

    async def frames(self, request: Request | None = None) -> list[messages.Message]:
        """Every frame available now, waiting for at least one.

        Raises ApiError 503 when no frame came within `first_frame_timeout_s`
        of arrival, 504 when the request outlived `request_timeout_s`, and
        Disconnected when `request` is given and its client went away.
        """
        frame = self.sub.get_nowait()
        if frame is None:
            frame = await self._wait(request)
        batch = [frame]
        while (more := self.sub.get_nowait()) is not None:
            batch.append(more)
        now = time.perf_counter()
        if self.t_first_frame is None:
            self.t_first_frame = now
        for f in batch:
            if isinstance(f, messages.TokenDelta):
                if f.token_ids and self.t_first_token is None:
                    self.t_first_token = now
                if f.token_ids and self.t_last_token is not None and self.t_last_token != now:
                    self.itl_s.append(now - self.t_last_token)
                if f.token_ids:
                    self.t_last_token = now
                self.tokens += len(f.token_ids)
            elif isinstance(f, messages.Finished):
                self.t_end = now
                self.finished = True
            elif isinstance(f, messages.Failed):
                self.t_end = now
                self.failure = f
                # A failure the gateway made up (lost pub/sub, slow client) is news to the workers.
                self.finished = not self.sub.aborted
        return batch

    async def _wait(self, request: Request | None) -> messages.Message:
        gw = self.gw
        start = self.prep.t_arrival
        while True:
            now = time.perf_counter()
            if self.t_first_frame is None and now - start >= gw.first_frame_timeout_s:
                raise ApiError(503, f"no output from the fleet within {gw.first_frame_timeout_s:g} s; the workers "
                                    "are overloaded, stuck or gone (see `skyline status`)", code="first_frame_timeout")
            if now - start >= gw.request_timeout_s:
                raise ApiError(504, f"request did not finish within {gw.request_timeout_s:g} s", code="request_timeout")
            limit = gw.request_timeout_s if self.t_first_frame is not None else gw.first_frame_timeout_s
            wait = start + limit - now
            if request is not None:
                wait = min(wait, DISCONNECT_POLL_S)
            try:
                async with asyncio.timeout(wait):
                    return await self.sub.get()
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise Disconnected() from None

    # ---- results --------------------------------------------------------------------

    def ttft_s(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.prep.t_arrival

    def tpot_s(self, completion_tokens: int) -> float | None:
        if self.t_first_token is None or self.t_end is None or completion_tokens < 2:
            return None
        return (self.t_end - self.t_first_token) / (completion_tokens - 1)

    def latency(self, fin: messages.Finished) -> tuple[float | None, float | None, bool]:
        """(TTFT s, TPOT s, SLO met) as the gateway measured them. TPOT is None below two
        tokens, and then only TTFT decides whether the SLO was met."""
        slo = self.prep.slo
        ttft, tpot = self.ttft_s(), self.tpot_s(fin.completion_tokens or self.tokens)
        met = ttft is not None and ttft * 1000 <= slo.ttft_ms and (tpot is None or tpot * 1000 <= slo.tpot_ms)
        return ttft, tpot, met

    def skyline(self, fin: messages.Finished) -> dict[str, Any]:
        """The `skyline` extension of the response: how this request was served and whether its SLO held."""
        slo = self.prep.slo
        ttft, tpot, met = self.latency(fin)
        return {
            "request_id": self.request_id,
            "tier": slo.tier,
            "route": self.prep.route,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
            "tpot_ms": None if tpot is None else round(tpot * 1000, 3),
            "slo_target": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "slo_met": met,
            "admission": self.prep.admission,
            "predicted_ttft_ms": None if self.prep.predicted_ttft_ms is None else round(self.prep.predicted_ttft_ms, 1),
            "prefill_worker": fin.prefill_worker,
            "decode_worker": fin.decode_worker,
            "decode_attempts": fin.attempts,  # > 1: the stream migrated to another decode worker
            "resumed_at_token": fin.resumed_at_token,
            "kv_transfer": fin.kv_transfer,
            "placement": None if self.placement is None else {
                "worker": self.placement.worker, "matched_blocks": self.placement.matched_blocks,
                "until_ms": self.placement.until_ms},
            "timings": fin.timings,
            "gateway_timings": self.gateway_timings(),
        }

    def gateway_timings(self) -> dict[str, float | None]:
        """Where the gateway's TTFT went (ms): rendering and checks (vLLM's serving code, then Skyline's SLO
        and route), admission + subscribe + enqueue, and the fleet until the first token frame came back."""
        p = self.prep

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None or not a else round((b - a) * 1000, 3)

        return {"render_ms": ms(p.t_arrival, p.t_prepared), "enqueue_ms": ms(p.t_prepared, self.t_enqueued),
                "fleet_first_token_ms": ms(self.t_enqueued, self.t_first_token)}

    def usage(self, fin: messages.Finished) -> dict[str, int]:
        prompt = fin.prompt_tokens or len(self.prep.request.prompt_token_ids)
        completion = fin.completion_tokens or self.tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- ending ---------------------------------------------------------------------

    def cancel(self, reason: str) -> None:
        """Tell the fleet to drop this request. Fire-and-forget: the caller may itself be
        cancelled (client disconnect), and an await there would be cancelled with it."""
        if self.cancelled or self.finished:
            return
        self.cancelled = True
        self.cancel_reason = reason
        task = asyncio.get_running_loop().create_task(self._publish_cancel(reason))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _publish_cancel(self, reason: str) -> None:
        rid = self.request_id
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.set(self.keys.cancelled(rid), 1, ex=TOMBSTONE_TTL_S)
            pipe.publish(self.keys.cancel, messages.encode(messages.Cancel(rid, reason)))
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not cancel %s (%s): %s", rid, reason, exc)

    def close(self, status: int, fin: messages.Finished | None = None) -> None:
        """Unsubscribe, cancel if the fleet may still be working on it, record metrics. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.cancel("client_disconnected" if status == 499 else "gateway_abort")
        self.relay.unsubscribe(self.sub)
        self.metrics.in_flight.labels(self.prep.request.model).dec()
        # What the request's end records (metrics, timeline, SLO record, calibration, budgets) runs
        # after the response's last bytes are written: a stream's last chunk waits for the end of its
        # generator, and these cost more than the rest of the gateway's part of a short request.
        try:
            asyncio.get_running_loop().call_soon(self._record, status, fin)
        except RuntimeError:  # no event loop (a unit test closing a session by hand)
            self._record(status, fin)

    def _record(self, status: int, fin: messages.Finished | None) -> None:
        m = self.metrics
        model = self.prep.request.model  # the base model's served name: its series (gateway/metrics.py)
        m.count(self.prep.slo.tier, self.prep.route, status, model)
        if fin is not None:
            ttft, tpot, met = self.latency(fin)
            end = self.t_end if self.t_end is not None else time.perf_counter()
            m.finished(self.prep.slo.tier, ttft, tpot, end - self.prep.t_arrival, met, model)
            if ttft is not None and self.prep.predicted_ttft_ms is not None:
                m.prediction_error.labels(model, self.prep.slo.tier).observe(ttft - self.prep.predicted_ttft_ms / 1000)
        for hook in self.on_close:
            hook(self, status, fin)
