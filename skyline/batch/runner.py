"""The batch job: send a batch's remaining lines through the gateway, paced by fleet load.

Runs inside `skyline batch-runner` (skyline/batch/worker.py) as the RQ job
`run_batch_job(batch_id, key_prefix)`. Each line goes to the gateway's
`POST /skyline/batches/{id}/lines/{line}`, which runs it through the normal
OpenAI path in the batch SLO tier (auth, validation, admission, EDF queues)
and records the result in Redis itself before answering. So:

- a runner killed mid-request loses nothing: the gateway still records the
  answer, and the request is not sent again;
- a restarted runner (RQ retry of the abandoned job) skips every recorded
  line, and waits for lines a gateway is still running (their claim key);
- only a gateway dying mid-request can make a line run twice (its claim
  expires and the line is sent again): at-least-once, one output line each.

Concurrency follows `BatchPacer` (scheduler/batch_pacing.py): the runner
samples the `skyline:backlog` hash every `batch.pacing_interval_s`. Lines the
gateway refuses for load (429/503/504, unreachable) are retried with
exponential backoff; after `batch.max_attempts` they become error lines.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from skyline.batch import jsonl
from skyline.batch.objects import TERMINAL
from skyline.batch.store import BatchStore
from skyline.core import redisconn
from skyline.core import tracing
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.scheduler.batch_pacing import BatchPacer, PacingPolicy, fleet_load, slo_pressure, stricter_tiers

log = logging.getLogger("skyline.batch")

LOAD_SIGNALS = frozenset({429, 503})  # retryable answers that also mean "too much load": back off
RETRY_BASE_S = 1.0
RETRY_MAX_S = 30.0
IN_PROGRESS_RECHECK_S = 1.0  # a line another gateway is running: look again this much later
RECENT_SAMPLE = 256  # latest answers read per sample (newest first; older ones were seen before)


class BatchInterrupted(Exception):
    """The runner is stopping (SIGTERM): the job fails on purpose so RQ re-enqueues it (it resumes)."""


class RunnerMisconfigured(Exception):
    """The gateway refused the runner itself (wrong API key, no batch route): no line can run."""


@dataclass
class RunnerContext:
    """What the RQ job needs from the process that runs it (set by `skyline batch-runner`)."""

    cfg: SkylineConfig
    gateway_url: str
    api_key: str | None
    stopping: threading.Event


_context: RunnerContext | None = None


def configure(ctx: RunnerContext) -> None:
    global _context
    _context = ctx


def run_batch_job(batch_id: str, key_prefix: str) -> dict[str, Any]:
    """The RQ job function. Returns the batch's final status and counts (RQ keeps it as the job result)."""
    if _context is None:
        raise RuntimeError("batch jobs must run in `skyline batch-runner` (it configures the gateway URL and pacing)")
    ctx = _context
    if key_prefix != ctx.cfg.key_prefix:
        ctx = replace(ctx, cfg=replace(ctx.cfg, key_prefix=key_prefix))
    return asyncio.run(BatchRun(ctx, batch_id).run())


def on_job_failure(job, connection, exc_type, exc_value, _tb) -> None:
    """RQ failure callback (an exception, or an abandoned job): fail the batch once RQ stops retrying."""
    if job.retries_left:
        log.warning("batch %s: runner failed (%s: %s); RQ retries it (%d left)", job.id,
                    getattr(exc_type, "__name__", exc_type), exc_value, job.retries_left)
        return
    batch_id, key_prefix = job.args[0], job.args[1]
    message = (f"the batch runner failed and RQ has no retries left: "
               f"{getattr(exc_type, '__name__', exc_type)}: {exc_value or 'runner process lost'}")
    fail_batch_sync(connection, Keys(key_prefix), batch_id, "runner_failed", message)


def fail_batch_sync(conn, keys: Keys, batch_id: str, code: str, message: str) -> None:
    import json

    from skyline.batch.store import _TRANSITION

    errors = json.dumps([jsonl.LineError(None, None, code, message).as_batch_error()])
    conn.eval(_TRANSITION, 1, keys.batch(batch_id), "validating in_progress finalizing cancelling", "failed",
              "failed_at", int(time.time()), "errors", errors)


@dataclass(order=True)
class _Retry:
    due: float
    line: int
    item: jsonl.BatchLine = field(compare=False)


class BatchRun:
    """One execution of one batch's job."""

    def __init__(self, ctx: RunnerContext, batch_id: str):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.bc = ctx.cfg.batch
        self.batch_id = batch_id
        self.keys = Keys(ctx.cfg.key_prefix)
        self.sent = 0  # requests this execution sent (for the log and the job result)

    async def run(self) -> dict[str, Any]:
        # With --otlp-traces-endpoint: one span for this execution of the job, the parent of every line's
        # request (the gateway passes its context on to each line's trace).
        with tracing.job_span(self.cfg.observability.otlp_traces_endpoint, "skyline.batch",
                              {"skyline.batch.id": self.batch_id}) as (span, carrier):
            result = await self._run_with(carrier)
            if span is not None:
                span.set_attributes({"skyline.batch.status": str(result.get("status")),
                                     "skyline.batch.sent": self.sent})
            return result

    async def _run_with(self, trace_headers: dict[str, str]) -> dict[str, Any]:
        r = redisconn.connect(self.cfg.redis)
        headers = {"authorization": f"Bearer {self.ctx.api_key}"} if self.ctx.api_key else {}
        headers.update(trace_headers)
        timeout = httpx.Timeout(self.cfg.gateway.request_timeout_s + 60, connect=10)
        limits = httpx.Limits(max_connections=self.bc.max_concurrency + 4)
        try:
            async with httpx.AsyncClient(base_url=self.ctx.gateway_url, headers=headers, timeout=timeout,
                                         limits=limits) as http:
                self.store = BatchStore(r, self.keys, self.bc.file_ttl_s)
                self.http = http
                return await self._run()
        finally:
            await r.aclose()

    async def _run(self) -> dict[str, Any]:
        store, bid = self.store, self.batch_id
        fields = await store.batch_fields(bid)
        if fields is None:
            log.warning("batch %s: no such batch (expired?); nothing to run", bid)
            return {"status": "missing"}
        if fields["status"] in TERMINAL:
            return {"status": fields["status"]}
        content = await store.file_content(fields["input_file_id"])
        if content is None:
            await store.fail(bid, [jsonl.LineError(None, None, "file_not_found",
                                                   f"input file {fields['input_file_id']} no longer exists")])
            return {"status": "failed"}
        parsed = await asyncio.to_thread(jsonl.parse_input, content, fields["endpoint"], self.bc.max_lines)
        if parsed.fatal:
            await store.fail(bid, parsed.fatal)
            return {"status": "failed"}
        custom_ids = parsed.custom_ids()
        if fields["status"] == "cancelling":
            return await self._finish("cancelled", custom_ids)
        if self._expired(fields):
            return await self._finish("expired", custom_ids)
        extra = {} if fields.get("in_progress_at") else {"in_progress_at": int(time.time())}
        moved, was = await store.transition(bid, ("validating", "in_progress", "finalizing"), "in_progress", **extra)
        if not moved:
            return await self._finish("cancelled", custom_ids) if was == "cancelling" else {"status": was}
        done = await store.done_lines(bid)
        todo = deque(item for item in parsed.requests if item.line not in done)
        log.info("batch %s: %d requests, %d already done, %d to send", bid, parsed.total,
                 parsed.total - len(todo) - len(parsed.errors), len(todo))
        outcome = await self._send_all(todo, int(fields["expires_at"]))
        if outcome == "completed":
            await store.transition(bid, ("in_progress",), "finalizing", finalizing_at=int(time.time()))
        return await self._finish(outcome, custom_ids)

    def _expired(self, fields: dict[str, str]) -> bool:
        return time.time() >= int(fields.get("expires_at") or 0) > 0

    async def _finish(self, status: str, custom_ids: dict[int, str | None]) -> dict[str, Any]:
        fill = {
            "completed": ("missing_result", "no result was recorded for this request"),
            "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
            "expired": ("batch_expired", "the batch's completion window ended before this request ran"),
        }[status]
        obj = await self.store.finalize(self.batch_id, custom_ids, status, *fill)
        counts = (obj or {}).get("request_counts")
        log.info("batch %s: %s (%s); %d requests sent by this runner", self.batch_id,
                 (obj or {}).get("status"), counts, self.sent)
        return {"status": (obj or {}).get("status"), "request_counts": counts, "sent": self.sent}

    # ---- sending ------------------------------------------------------------------------

    async def _send_all(self, todo: deque[jsonl.BatchLine], expires_at: int) -> str:
        """Send every line in `todo` at the paced concurrency. Returns how the batch ends:
        "completed", "cancelled" or "expired". Raises BatchInterrupted when the runner stops."""
        bc = self.bc
        pacer = BatchPacer(PacingPolicy(bc.min_concurrency, bc.max_concurrency, bc.start_concurrency,
                                        bc.backoff_tokens, bc.fill_tokens, bc.max_batch_backlog_tokens,
                                        bc.backoff_slo_pressure, bc.fill_slo_pressure))
        stricter = stricter_tiers(self.cfg.tiers, bc.tier)
        seen_ms = int(time.time() * 1000)  # live answers older than the batch's start say nothing about it
        retries: list[_Retry] = []
        attempts: dict[int, int] = {}
        inflight: dict[asyncio.Task, jsonl.BatchLine] = {}
        next_sample = 0.0
        ending: str | None = None
        try:
            while todo or retries or inflight:
                now = time.monotonic()
                if now >= next_sample:
                    next_sample = now + bc.pacing_interval_s
                    if self.ctx.stopping.is_set():
                        raise BatchInterrupted("the batch runner is stopping; RQ re-enqueues the batch")
                    status = await self.store.status(self.batch_id)
                    if status != "in_progress":  # cancelling (or ended by someone else): stop sending
                        ending = "cancelled"
                    elif time.time() >= expires_at:
                        ending = "expired"
                    backlog, answers = await self._sample()
                    pressure, seen_ms = slo_pressure(answers, stricter, seen_ms)
                    limit = pacer.limit
                    if pacer.observe(fleet_load(backlog, stricter, bc.tier, pressure)) != limit:
                        log.debug("batch %s: concurrency %d -> %d (backlog %s, SLO pressure %.2f)",
                                  self.batch_id, limit, pacer.limit, backlog, pressure)
                    if ending:  # in-flight lines finish (the gateway records them); nothing new goes out
                        todo.clear()
                        retries.clear()
                while retries and retries[0].due <= now:
                    todo.appendleft(heapq.heappop(retries).item)
                while todo and len(inflight) < pacer.limit:
                    item = todo.popleft()
                    inflight[asyncio.create_task(self._send(item))] = item
                wake = next_sample - time.monotonic()
                if retries:
                    wake = min(wake, retries[0].due - time.monotonic())
                if not inflight:
                    await asyncio.sleep(max(0.0, wake))
                    continue
                finished, _ = await asyncio.wait(inflight, timeout=max(0.0, wake),
                                                 return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    item = inflight.pop(task)
                    outcome, status_code, detail = task.result()
                    if outcome == "retry":
                        if status_code in LOAD_SIGNALS:
                            pacer.pushback()
                        attempts[item.line] = n = attempts.get(item.line, 0) + 1
                        if n >= bc.max_attempts:
                            await self.store.record(self.batch_id, item.line, jsonl.error_line(
                                item.custom_id, "request_failed", f"gave up after {n} attempts: {detail}"))
                        else:
                            delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (n - 1))
                            heapq.heappush(retries, _Retry(time.monotonic() + delay, item.line, item))
                    elif outcome == "wait":
                        heapq.heappush(retries, _Retry(time.monotonic() + IN_PROGRESS_RECHECK_S, item.line, item))
                    elif outcome == "stop":
                        ending = ending or "cancelled"
                        next_sample = 0.0  # read the status now
        finally:
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
        return ending or "completed"

    async def _sample(self) -> tuple[dict[str, int], list[dict]]:
        """The fleet's backlog hash and the gateways' latest answers (`skyline:recent`)."""
        pipe = self.store.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.backlog)
        pipe.lrange(self.keys.recent, 0, RECENT_SAMPLE - 1)
        backlog, recent = await pipe.execute()
        answers = []
        for raw in recent:
            try:
                answers.append(json.loads(raw))
            except ValueError:
                continue
        return {k.decode(): int(v) for k, v in backlog.items()}, answers

    async def _send(self, item: jsonl.BatchLine) -> tuple[str, int, str]:
        """One line to the gateway: ("ok" | "retry" | "wait" | "stop", HTTP status, detail)."""
        self.sent += 1
        try:
            resp = await self.http.post(f"/skyline/batches/{self.batch_id}/lines/{item.line}",
                                        json={"custom_id": item.custom_id, "url": item.url, "body": item.body})
        except httpx.HTTPError as exc:
            return "retry", 0, f"gateway unreachable at {self.ctx.gateway_url}: {type(exc).__name__}: {exc}"
        if resp.status_code == 200:
            return "ok", 200, ""
        detail, code = _error_of(resp)
        if resp.status_code == 409:
            return ("wait" if code == "line_in_progress" else "stop"), 409, detail
        if resp.status_code in jsonl.RETRYABLE_STATUSES:
            return "retry", resp.status_code, f"HTTP {resp.status_code}: {detail}"
        # 401/404/400 on the runner's own route: no line could ever run; fail the job, saying why.
        raise RunnerMisconfigured(f"the gateway at {self.ctx.gateway_url} refused the batch runner: "
                                  f"HTTP {resp.status_code}: {detail}")


def _error_of(resp: httpx.Response) -> tuple[str, str | None]:
    try:
        err = resp.json().get("error") or {}
        return str(err.get("message") or resp.text[:300]), err.get("code")
    except ValueError:
        return resp.text[:300], None

