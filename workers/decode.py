"""Decode role: pull the prompt's KV (or prefill locally), stream tokens to the client.

Frames go to the request's pub/sub channel through the fenced publish script
(workers/runs.py), which also logs the tokens and the frame sent. PUBLISH answers
how many subscribers got the frame; 0 means the gateway no longer listens (the
client left, or the gateway died), so the engine request is aborted instead of
generating tokens for nobody: once nobody has listened for `outage_grace_s`,
since a gateway whose relay lost Redis (a restart) re-subscribes within that
time and catches up from the frame log. The entry is acked after the final frame.

Redis unreachable: the claim, the publishes and the ack are retried for up to
`outage_grace_s` (workers/outage.py) and the stream goes on where it was. If
Redis came back without the frames this attempt had published (STATE_LOST:
its data was lost), the request ends with a `redis_state_lost` error.

Migration: claiming a request's decode work bumps its attempt number. When an
earlier attempt already streamed tokens (its worker died or stalled and the
reaper handed the entry to this worker), this attempt prefills prompt + those
tokens locally and generates the rest, numbering frames and token positions
on from where the client is: the stream continues with no gap and no
duplicate. The earlier worker, if it is still alive, is fenced out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from skyline.core import messages
from skyline.core.streams import now_ms
from skyline.scheduler import migration
from skyline.scheduler.disagg import handle_expired
from skyline.scheduler.migration import resume_refusal
from skyline.workers import observe
from skyline.workers.engines.base import EngineRequest, GenerationChunk, KVPullFailed, RequestRefused
from skyline.workers.held import Fenced, HeldRequest
from skyline.workers.outage import ride_out
from skyline.workers.port import WorkerPort
from skyline.workers.prefill import engine_request
from skyline.workers.publisher import BatchPublisher
from skyline.workers.runs import FENCED, STATE_LOST, RunClaim

log = logging.getLogger("skyline.worker.decode")


class ClientGone(Exception):
    """Nobody subscribes to the request's token channel any more."""


class StateLost(Exception):
    """Redis lost frames of this request that were already published (its data was lost)."""


class DecodeHandler:
    def __init__(self, port: WorkerPort):
        self.port = port
        self.grace_s = port.cfg.redis.outage_grace_s
        self.publisher = BatchPublisher(port.redis, port.runs.publish_script, self.grace_s)
        port.on_start.append(self.publisher.start)

    async def __call__(self, held: HeldRequest) -> None:
        source = _Source(None, "")
        try:
            await self._serve(held, source)
        except Fenced:
            raise  # another worker owns the request now, and its handle with it
        except StateLost as exc:
            rid = str(exc)
            await self.port.engine.abort(rid)
            log.error("%s: Redis came back without frames already published; failing it", rid)
            await self.port.fail(held, 502, "Redis lost this request's state (it restarted without the output "
                                             "already sent); retry the request", code="redis_state_lost",
                               dead_letter=False)
        except BaseException:
            # Ended before the engine took the prompt's handle (the client left while the entry was
            # being claimed, or it failed): nobody will pull those blocks, so free them now rather
            # than at the end of the prefill engine's lease. Not when the entry goes back to the
            # queue (preempted, handed back): the next attempt pulls them.
            if source.unpulled is not None and not held.returning_to_queue:
                await self._release(held.request, source.unpulled)
            raise

    async def _release(self, req: messages.GenerateRequest, handle: dict) -> None:
        try:
            # Shielded: a second cancellation must not leave the blocks held after all.
            await asyncio.shield(self.port.engine.release_kv(req.request_id, handle))
        except Exception:  # noqa: BLE001 - the lease still frees them
            log.warning("could not release the prefill engine's KV blocks of %s; its lease will", req.request_id,
                        exc_info=True)
            return
        self.port.timeline.emit(req.request_id, "kv_released", source_engine=handle.get("remote_engine_id"))

    async def _serve(self, held: HeldRequest, source: _Source) -> None:
        claimed = held.claimed
        work = held.work
        if not isinstance(work, messages.DecodeWork):
            await self.port.fail(held, 500, f"decode stream carried a {type(work).__name__}, expected decode work")
            return
        req = work.request
        run, claimed.run = claimed.run, None  # claimed with the entry (Runs.take), unless reclaimed
        if work.kv_handle is not None and (run is None or run.attempt == 1):
            source.unpulled = work.kv_handle  # this attempt's to pull, or to free if it ends first
        if run is None:
            run = await ride_out(lambda: self.port.runs.claim(req.request_id, self.port.worker_id), self.grace_s,
                                 f"claiming {req.request_id}")
        if run.done:  # an earlier attempt sent the final frame and died before its ack
            await self.port.ack(held)
            return
        if run.attempt > 1:
            source.unpulled = None  # an earlier attempt had the handle (and may have pulled it)
        stream = _Stream(self, req, run)
        if run.output:
            self.port.timeline.emit(req.request_id, "migrated", attempt=run.attempt, resumed_at_token=len(run.output))
        sp = req.sampling
        refusal = resume_refusal(sp.temperature, sp.seed, sp.n, sp.params) if run.output else None
        if refusal:
            await stream.fail(500, f"the decode worker serving this request died mid-stream, and {refusal}; "
                                   "retry the request", code="migration_refused")
            await self.port.ack(held)
            return
        ereq, source.kv_handle, source.why_local = await self._plan(work, run)
        if source.kv_handle is None:
            source.unpulled = None  # expired, or its prefill worker is gone: nothing to free
        else:
            source.prefill_finished_ms = work.prefill_finished_ms
            await held.tombstone_checked()  # a client gone meanwhile: its blocks freed below
        if source.why_local:
            observe.pd_fallback(self.port, req, source.why_local)
        started = now_ms()
        first_token_ms = 0
        last_chunk_s = None  # when this stream's previous tokens came: its pace feeds the claim rule
        finish_reason = "length" if ereq.sampling.max_tokens <= 0 else "abort"
        prefilled_here = False  # the prompt was computed on this engine: measured and released after the first frame
        last: GenerationChunk | None = None  # the engine's last chunk, sent together with the final frame
        kv_transfer: dict = {}
        # Prompt logprobs come from where the prompt was computed: the prefill engine's, handed off.
        prompt_logprobs = work.prompt_logprobs if source.kv_handle is not None else None
        try:
            if ereq.sampling.max_tokens > 0:
                async for chunk in self._chunks(ereq, req, source):
                    if held.cancel_pending:  # a cancellation dropped on its way (HeldRequest.cancel_pending)
                        raise asyncio.CancelledError(f"{req.request_id} was cancelled by its worker")
                    if chunk.token_ids or chunk.text:
                        t = time.monotonic()
                        if last_chunk_s is not None:
                            self.port.pace.record(t, t - last_chunk_s, len(chunk.token_ids))
                        last_chunk_s = t
                        if not first_token_ms:
                            first_token_ms = observe.first_token(self.port, req, started, source.kv_handle is not None)
                            held.first_token()
                            prefilled_here = source.kv_handle is None
                    if chunk.done and self.publisher.in_order_batches:
                        # The last tokens go out in one round trip with the final frame (below): the
                        # gateway closes the response as soon as they arrive instead of one publish later.
                        last = chunk
                    elif chunk.token_ids or chunk.text or chunk.finish_reason or chunk.prompt_logprobs:
                        await stream.delta(chunk, prompt_logprobs)
                        prompt_logprobs = None
                    if prefilled_here and last is None:  # after the first token is on its way
                        prefilled_here = False
                        await self._prefilled_here(held, started, first_token_ms, len(ereq.prompt_token_ids))
                    if chunk.finish_reason:
                        finish_reason = chunk.finish_reason
                    if chunk.done:
                        kv_transfer = dict(chunk.kv_transfer)
        except RequestRefused as exc:
            await stream.fail(exc.status, exc.message, code="unsupported_by_engine")
            await self.port.ack(held)
            return
        except (ClientGone, Fenced) as exc:
            await self.port.engine.abort(req.request_id)
            if isinstance(exc, Fenced):
                raise  # another worker owns the request now: leave the entry to it
            log.info("client of %s is gone; aborting", req.request_id)
            self.port.timeline.emit(req.request_id, "cancelled", phase="decode", reason="client_gone")
            await self.port.ack(held)
            return
        if source.why_local:
            kv_transfer["local_prefill"] = source.why_local
        if work.decode_placed or held.decode_placed:  # an elastic worker's choice of where to decode
            kv_transfer["decode_placed"] = work.decode_placed or held.decode_placed
        done = now_ms()
        timings = {
            "queue_ms": (work.prefill_started_ms or started) - req.arrival_ms,
            "prefill_ms": work.prefill_finished_ms - work.prefill_started_ms if work.kv_handle else 0,
            "decode_queue_ms": started - work.prefill_finished_ms if work.kv_handle else 0,
            "first_token_ms": (first_token_ms or done) - req.arrival_ms,
            "decode_ms": done - started,
            "e2e_ms": done - req.arrival_ms,
        }
        last_frame = stream.delta_frame(last, prompt_logprobs) if last is not None else None
        final = messages.Finished(
            request_id=req.request_id, seq=stream.seq + (last_frame is not None), finish_reason=finish_reason,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=stream.produced + (len(last.token_ids) if last is not None else 0), timings=timings,
            kv_transfer=kv_transfer, decode_worker=self.port.worker_id, prefill_worker=work.prefill_worker,
            attempts=run.attempt, resumed_at_token=len(run.output),
        )
        observe.decode_done(self.port, final, done)
        if last_frame is not None:
            await stream.send_last(last_frame, last.token_ids, final)
        else:
            await stream.send(final, [], final=True)
        if prefilled_here:
            await self._prefilled_here(held, started, first_token_ms, len(ereq.prompt_token_ids))
        await self.port.ack(held)

    async def _chunks(self, ereq: EngineRequest, req: messages.GenerateRequest,
                      source: _Source) -> AsyncIterator[GenerationChunk]:
        """The engine's chunks, with the prompt's KV pulled from `source` if it has a handle; if the
        pull fails before anything was generated, the prompt is computed here instead (NIXL handshake
        or transfer failed, or timed out): counted and shown as a fallback, never a silent bypass.

        So it is when the pull completes (the first output comes) past the handle's life: the prefill
        engine may have freed and reused the blocks while they were read. The output is dropped unseen
        and the prompt computed here."""
        source.unpulled = None  # the engine owns the handle now: an abort frees the blocks through vLLM
        gen = self.port.engine.generate(ereq, source.kv_handle)
        lease_s = self.port.cfg.engine.kv_lease_s
        try:
            async for chunk in gen:
                if source.prefill_finished_ms is not None:  # the first output: the pull is complete
                    age = now_ms() - source.prefill_finished_ms
                    source.prefill_finished_ms = None
                    if handle_expired(age, lease_s):
                        log.warning("the KV pull of %s completed %d ms after its prefill, past the handle's "
                                    "life; dropping its output and prefilling it locally", req.request_id, age)
                        await self.port.engine.abort(ereq.request_id)
                        await gen.aclose()  # before the same request id goes to the engine again
                        why = "kv_pull_late"
                        break
                yield chunk
            else:
                return
        except KVPullFailed as exc:
            if source.kv_handle is None:
                raise
            log.warning("%s; prefilling %s locally", exc, req.request_id)
            why = "kv_pull_failed"
        source.kv_handle, source.why_local = None, why
        observe.pd_fallback(self.port, req, source.why_local)
        async for chunk in self.port.engine.generate(ereq, None):
            yield chunk

    async def _prefilled_here(self, held: HeldRequest, started_ms: int, first_token_ms: int, tokens: int) -> None:
        """This worker computed the prompt itself (colocated route, or a local
        re-prefill): measure its prefill rate, which admission control uses for
        colocated routes, and take the prompt off the prefill backlog now rather
        than when the whole answer is done (it is no longer work ahead of anyone)."""
        self.port.meter.record(started_ms, first_token_ms, tokens)
        await self.port.release_prefill(held)

    async def _plan(self, work: messages.DecodeWork, run: RunClaim) -> tuple[EngineRequest, dict | None, str]:
        """What to give the engine: the request (continued after the tokens already
        sent, on a migration), the KV handle to pull or None to prefill here, and
        why the prompt is prefilled here when a handle existed."""
        req = work.request
        ereq = engine_request(req, observe.trace_headers(self.port, req))
        if run.output:
            ereq.prompt_token_ids = list(req.prompt_token_ids) + run.output
            ereq.sampling = replace(req.sampling, max_tokens=req.sampling.max_tokens - len(run.output),
                                    params=migration.remaining(req.sampling.params, len(run.output)))
        if work.kv_handle is None:
            return ereq, None, ""
        if run.attempt > 1:
            # An earlier attempt may have pulled (and so released) these blocks, or
            # its prefill may now be stale: recompute rather than risk reading reused KV.
            return ereq, None, "decode_retry"
        if work.prefill_worker == self.port.worker_id:
            # An elastic worker's own hand-off, taken back after no peer claimed it: the prompt's blocks
            # are in this engine's prefix cache (vLLM cannot pull from itself). Its lease frees them.
            return ereq, None, "own_handoff"
        age = now_ms() - work.prefill_finished_ms
        if handle_expired(age, self.port.cfg.engine.kv_lease_s):
            # The prefill engine may already have reused these blocks: pulling them
            # could silently produce wrong output. Prefill here instead.
            log.warning("KV handle of %s is %d ms old; prefilling locally", req.request_id, age)
            return ereq, None, "handle_expired"
        # A hand-off younger than the liveness window comes from a worker that was alive
        # then; a death since would not show in its heartbeat yet anyway.
        fresh = age < 3000 * self.port.cfg.worker.heartbeat_s
        if work.prefill_worker and not fresh and not await self.port.is_alive(work.prefill_worker):
            log.warning("prefill worker %s of %s is gone; prefilling locally", work.prefill_worker, req.request_id)
            return ereq, None, "prefill_worker_gone"
        return ereq, work.kv_handle, ""


@dataclass
class _Source:
    """Where this attempt's prompt KV comes from: a prefill engine's handle, or None (computed here,
    `why_local` saying why when a handle existed)."""

    kv_handle: dict | None
    why_local: str
    unpulled: dict | None = None  # a handle this attempt must pull or free, until the engine takes it
    prefill_finished_ms: float | None = None  # of the handle to pull, until the pull is seen complete


class _Stream:
    """The output side of one attempt: frame numbering continued from earlier attempts."""

    def __init__(self, handler: DecodeHandler, req: messages.GenerateRequest, run: RunClaim):
        self.h = handler
        self.req = req
        self.run = run
        self.channel = handler.port.keys.tokens(req.request_id)
        self.seq = run.frames
        self.produced = len(run.output)
        self.unheard_since: float | None = None  # monotonic time of the first publish nobody received

    def delta_frame(self, chunk: GenerationChunk, prompt_logprobs: list | None) -> messages.TokenDelta:
        return messages.TokenDelta(
            self.req.request_id, self.seq, self.produced, chunk.token_ids, chunk.text, choice=chunk.choice,
            logprobs=chunk.logprobs, cumulative_logprob=chunk.cumulative_logprob, finish_reason=chunk.finish_reason,
            stop_reason=chunk.stop_reason, prompt_logprobs=prompt_logprobs or chunk.prompt_logprobs)

    async def delta(self, chunk: GenerationChunk, prompt_logprobs: list | None) -> None:
        receivers = await self.send(self.delta_frame(chunk, prompt_logprobs), chunk.token_ids)
        self.produced += len(chunk.token_ids)
        if receivers > 0:
            self.unheard_since = None
            return
        # Nobody listens: the client left, or its gateway's relay is reconnecting (it catches up
        # from the frame log). Only silence past the grace means the client is gone.
        now = time.monotonic()
        if self.unheard_since is None:
            self.unheard_since = now
        if now - self.unheard_since >= self.h.grace_s:
            raise ClientGone

    async def send_last(self, frame: messages.TokenDelta, token_ids: list[int], final: messages.Finished) -> None:
        """The last tokens and the final frame in one pipeline (Redis runs them in order). Nobody
        listening is no reason to abort any more: the request is done."""
        runs, rid, attempt = self.h.port.runs, self.req.request_id, self.run.attempt
        calls = [runs.publish_args(rid, attempt, self.channel, messages.encode(frame), False, token_ids, self.seq),
                 runs.publish_args(rid, attempt, self.channel, messages.encode(final), True, [], self.seq + 1)]
        results = await self.h.publisher.publish_in_order(calls)
        if FENCED in results:
            raise Fenced(f"{rid}: attempt {attempt} was taken over")
        if STATE_LOST in results:
            raise StateLost(rid)
        self.seq += 2
        self.produced += len(token_ids)

    async def fail(self, status: int, message: str, code: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        await self.send(messages.Failed(self.req.request_id, self.seq, status, message, type=kind, code=code), [],
                        final=True)

    async def send(self, frame: messages.Message, token_ids: list[int], final: bool = False) -> int:
        keys, args = self.h.port.runs.publish_args(self.req.request_id, self.run.attempt, self.channel,
                                                 messages.encode(frame), final, token_ids, self.seq)
        receivers = await self.h.publisher.publish(keys, args)
        if receivers == FENCED:
            raise Fenced(f"{self.req.request_id}: attempt {self.run.attempt} was taken over")
        if receivers == STATE_LOST:
            raise StateLost(self.req.request_id)
        self.seq += 1
        return receivers
