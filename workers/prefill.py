"""Prefill role: run the prompt, publish the KV-block handle on the decode stream.

The engine computes the prompt's KV with `max_tokens=1` and keeps the blocks
(under the connector's lease) for a decode engine to pull over NIXL. The
handle travels with the request on the decode stream of the request's tier;
the prefill entry is acked only after that XADD, so a crash in between means
the request is prefilled again (at-least-once), never lost.
"""

from __future__ import annotations

import logging

from skyline import messages
from skyline.streams import Claimed, enqueue, now_ms
from skyline.workers.engines.base import EngineRequest
from skyline.workers.runtime import WorkerRuntime

log = logging.getLogger("skyline.worker.prefill")


def engine_request(req: messages.GenerateRequest) -> EngineRequest:
    return EngineRequest(req.request_id, req.prompt_token_ids, req.sampling, req.priority)


class PrefillHandler:
    def __init__(self, rt: WorkerRuntime):
        self.rt = rt

    async def __call__(self, claimed: Claimed) -> None:
        req = claimed.message
        if not isinstance(req, messages.GenerateRequest):
            await self.rt.fail(claimed, 500, f"prefill stream carried a {type(req).__name__}, expected a request")
            return
        started = now_ms()
        result = await self.rt.engine.prefill(engine_request(req))
        self.rt.meter.record(started, now_ms(), result.prompt_tokens)
        work = messages.DecodeWork(
            request=req, kv_handle=result.kv_handle, prefill_worker=self.rt.worker_id,
            prefill_started_ms=started, prefill_finished_ms=now_ms(),
        )
        await enqueue(self.rt.redis, self.rt.keys, "decode", work, self.rt.cfg.redis.stream_maxlen)
        await self.rt.queues.ack(claimed)
        log.debug("prefilled %s (%d tokens) in %d ms", req.request_id, result.prompt_tokens, work.prefill_finished_ms - started)
