"""Prefill role: run the prompt, publish the KV-block handle on the decode stream.

The engine computes the prompt's KV with `max_tokens=1` and keeps the blocks
(under the connector's lease) for a decode engine to pull over NIXL. The
handle travels with the request on the decode stream of the request's tier;
the prefill entry is acked only after that XADD, so a crash in between means
the request is prefilled again (at-least-once), never lost. The XADD is a
hand-off done once per request (workers/runs.py), so a second prefill of the
same request never reaches a decode worker.
"""

from __future__ import annotations

import asyncio
import logging

from skyline.core import messages
from skyline.core.streams import entry_fields, now_ms, open_lanes
from skyline.scheduler.elastic import HANDOFF_HOLD_MS
from skyline.workers import observe
from skyline.workers.engines.base import EngineRequest, RequestRefused
from skyline.workers.held import HeldRequest
from skyline.workers.outage import ride_out
from skyline.workers.port import WorkerPort

log = logging.getLogger("skyline.worker.prefill")


def engine_request(req: messages.GenerateRequest, trace_headers: dict[str, str] | None = None) -> EngineRequest:
    return EngineRequest(req.request_id, req.prompt_token_ids, req.sampling, req.priority, req.cache_salt,
                         targeted=not req.best_effort, adapter=req.adapter, trace_headers=trace_headers)


class PrefillHandler:
    def __init__(self, port: WorkerPort):
        self.port = port

    async def __call__(self, held: HeldRequest) -> None:
        req = held.claimed.message
        if not isinstance(req, messages.GenerateRequest):
            await self.port.fail(held, 500, f"prefill stream carried a {type(req).__name__}, expected a request")
            return
        started = now_ms()
        self.port.timeline.emit(req.request_id, "prefill_started", prompt_tokens=len(req.prompt_token_ids))
        try:
            result = await self.port.engine.prefill(engine_request(req, observe.trace_headers(self.port, req)))
        except RequestRefused as exc:  # a client error (an adapter it cannot load): answered, never retried
            await self.port.fail(held, exc.status, exc.message, code="unsupported_by_engine", dead_letter=False)
            return
        held.prompt_computed()  # no longer one to preempt: only the hand-off is left
        self.port.meter.record(started, now_ms(), result.prompt_tokens)
        work = messages.DecodeWork(
            request=req, kv_handle=result.kv_handle, prefill_worker=self.port.worker_id,
            prefill_started_ms=started, prefill_finished_ms=now_ms(), prompt_logprobs=result.prompt_logprobs,
            decode_placed=held.decode_placed,
        )
        keys, fields, peer = self.port.keys, entry_fields(work), held.decode_on
        stream = keys.stream("decode", req.tier) if peer is None else keys.affinity_lane("decode", req.tier, peer)
        if peer is not None:  # placed for the peer an elastic worker chose; anyone's past the hold
            fields["affinity"], fields["until_ms"] = peer, now_ms() + HANDOFF_HOLD_MS
        t_handoff = observe.prefill_finished(self.port, req, work, result.cached_tokens)

        async def hand_off() -> str | None:
            if peer is not None:  # its lane is read only once it exists (and again after a Redis restart)
                await open_lanes(self.port.redis, keys, "decode", (req.tier,), peer)
            return await self.port.runs.hand_off(req.request_id, stream, fields, self.port.worker_id,
                                                 self.port.cfg.redis.stream_maxlen)

        # A Redis restart meanwhile must not waste the prefill: the hand-off is done once per
        # request however often it is sent, so it is retried until Redis is back (outage.py).
        handing = asyncio.ensure_future(ride_out(hand_off, self.port.cfg.redis.outage_grace_s,
                                                 f"handing {req.request_id} off"))
        try:
            entry = await asyncio.shield(handing)
        except asyncio.CancelledError:
            # Cancelled (its client left, a preemption, a hand-back) with the prompt computed: the
            # blocks exist, so the hand-off completes and this request's work here is done. Dropped
            # instead, nobody would free them before the lease ends; handed off, the decode worker
            # that meets the client's tombstone frees them at once (workers/decode.py).
            entry = await handing
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        if entry is None:
            # Another attempt of this request (this entry was taken over while we
            # were slow, or delivered twice) handed it off first. Our KV blocks are
            # never pulled; the engine frees them when their lease expires.
            log.warning("%s was already handed off by another attempt; dropping this one", req.request_id)
        observe.handle_published(self.port, req, work, t_handoff, handed_off=entry is not None)
        await self.port.ack(held)
        log.debug("prefilled %s (%d tokens) in %d ms", req.request_id, result.prompt_tokens, work.prefill_finished_ms - started)
