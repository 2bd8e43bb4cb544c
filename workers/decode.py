"""Decode role: pull the prompt's KV (or prefill locally), stream tokens to the client.

Frames go to the request's pub/sub channel. PUBLISH answers how many
subscribers got the frame; 0 means the gateway no longer listens (the client
left, or the gateway died), so the engine request is aborted at once instead
of generating tokens for nobody. The entry is acked after the final frame.
"""

from __future__ import annotations

import logging

from skyline import messages
from skyline.streams import Claimed, now_ms
from skyline.workers.prefill import engine_request
from skyline.workers.publisher import BatchPublisher
from skyline.workers.runtime import WorkerRuntime

log = logging.getLogger("skyline.worker.decode")


class ClientGone(Exception):
    """Nobody subscribes to the request's token channel any more."""


class DecodeHandler:
    def __init__(self, rt: WorkerRuntime):
        self.rt = rt
        self.publisher = BatchPublisher(rt.redis)
        rt.on_start.append(self.publisher.start)

    async def __call__(self, claimed: Claimed) -> None:
        work = claimed.message
        if not isinstance(work, messages.DecodeWork):
            await self.rt.fail(claimed, 500, f"decode stream carried a {type(work).__name__}, expected decode work")
            return
        req = work.request
        channel = self.rt.keys.tokens(req.request_id)
        started = now_ms()
        kv_handle, handle_expired = work.kv_handle, False
        if kv_handle is not None and started - work.prefill_finished_ms > 800 * self.rt.cfg.engine.kv_lease_s:
            # The prefill engine may already have reused these blocks: pulling them
            # could silently produce wrong output. Prefill here instead.
            log.warning("KV handle of %s is %d ms old; prefilling locally", req.request_id, started - work.prefill_finished_ms)
            kv_handle, handle_expired = None, True
        first_token_ms = 0
        seq = produced = 0
        finish_reason = "abort"
        kv_transfer: dict = {}
        try:
            async for chunk in self.rt.engine.generate(engine_request(req), kv_handle):
                if chunk.token_ids or chunk.text:
                    first_token_ms = first_token_ms or now_ms()
                    frame = messages.TokenDelta(req.request_id, seq, produced, chunk.token_ids, chunk.text)
                    if await self.publisher.publish(channel, messages.encode(frame)) == 0:
                        raise ClientGone
                    seq += 1
                    produced += len(chunk.token_ids)
                if chunk.finish_reason:
                    finish_reason, kv_transfer = chunk.finish_reason, dict(chunk.kv_transfer)
                    if handle_expired:
                        kv_transfer["handle_expired"] = True
        except ClientGone:
            log.info("client of %s is gone; aborting", req.request_id)
            await self.rt.engine.abort(req.request_id)
            await self.rt.queues.ack(claimed)
            return
        done = now_ms()
        timings = {
            "queue_ms": (work.prefill_started_ms or started) - req.arrival_ms,
            "prefill_ms": work.prefill_finished_ms - work.prefill_started_ms if work.kv_handle else 0,
            "decode_queue_ms": started - work.prefill_finished_ms if work.kv_handle else 0,
            "first_token_ms": (first_token_ms or done) - req.arrival_ms,
            "decode_ms": done - started,
            "e2e_ms": done - req.arrival_ms,
        }
        final = messages.Finished(
            request_id=req.request_id, seq=seq, finish_reason=finish_reason, prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=produced, timings=timings, kv_transfer=kv_transfer,
            decode_worker=self.rt.worker_id, prefill_worker=work.prefill_worker,
        )
        await self.publisher.publish(channel, messages.encode(final))
        await self.rt.queues.ack(claimed)
