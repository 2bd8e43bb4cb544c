"""What every worker process does around its engine, whatever its role.

  - joins its stage's consumer group and claims work in EDF order while it has
    room (`max_running`, and a prompt-token budget for prefill);
  - heartbeats its load to `skyline:worker:<id>`;
  - listens on `skyline:cancel` and aborts requests it holds;
  - skips requests whose client already left (tombstone), and drops queued
    requests of tiers that would rather fail than be served this late;
  - takes over work of workers that died or stalled (workers/reaper.py) and
    dead-letters a request delivered `max_deliveries` times (poison);
  - on SIGTERM/SIGINT stops claiming, finishes what it holds (bounded by
    `drain_timeout_s`), hands the rest back to the stream, deregisters;
  - if its main loop dies, the process exits (no zombie worker that
    heartbeats but never serves).

The role-specific part is a `handle(claimed)` coroutine (prefill.py, decode.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from skyline.core import cache_view, messages, redisconn
from skyline.core.config import SkylineConfig
from skyline.core.fleet import WorkerInfo, deregister, heartbeat
from skyline.core.keys import Keys
from skyline.core.stopping import STOP_STEP_S, bounded_step
from skyline.core.streams import Claimed, TierQueues, enqueue, ensure_groups, needs_prefill, now_ms
from skyline.scheduler.claiming import RECHECK_S, ClaimRoom, ClaimShield
from skyline.scheduler.decode_room import TokenPaceMeter, pace_allows
from skyline.scheduler.edf import pick_tier
from skyline.scheduler.preemption import PreemptionPolicy, Waiting, victims
from skyline.scheduler.throughput import ThroughputMeter, rate_or_prior
from skyline.workers import observe
from skyline.workers.engine_watch import watch_engine
from skyline.workers.engines.base import Engine
from skyline.workers.outage import ride_out
from skyline.workers.reaper import forget_departed, reclaim, reclaim_previous_life
from skyline.workers.runs import Runs

log = logging.getLogger("skyline.worker")

STAGE_OF_ROLE = {"prefill": "prefill", "decode": "decode"}


class Fenced(Exception):
    """This worker's claim on a request was taken over; it must not publish or ack."""


class WorkerRuntime:
    def __init__(self, cfg: SkylineConfig, engine: Engine, model_name: str):
        role = cfg.worker.role
        if role not in STAGE_OF_ROLE:
            raise ValueError(f"unknown worker role {role!r}: expected prefill or decode")
        self.cfg = cfg
        self.engine = engine
        self.role = role
        self.stage = STAGE_OF_ROLE[role]
        self.keys = Keys(cfg.key_prefix)
        self.worker_id = cfg.worker.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.redis = redisconn.connect(cfg.redis, socket_keepalive=True, health_check_interval=10)
        self.queues = TierQueues(self.redis, self.keys, self.stage, cfg.tiers, self.worker_id,
                                 liveness_s=cfg.worker.reclaim_after_s)
        self.runs = Runs(self.redis, self.keys, cfg.redis.run_ttl_s, cfg.redis.outage_grace_s)
        # A decode worker claims an entry and its request's run in one round trip (workers/runs.py).
        self.take = functools.partial(self.runs.take, worker_id=self.worker_id) if self.stage == "decode" else None
        self.in_flight: dict[str, tuple[asyncio.Task, Claimed]] = {}
        self.prompt_tokens_in_flight = 0
        # Decode: prompts this worker computes itself (colocated route) that have no first token
        # yet, id -> tokens. They hold the engine's step budget like a prefill worker's prompts,
        # so the same budget and the same preemption apply to them.
        self.local_prefills: dict[str, int] = {}
        # Prefill: prompts the engine has finished, being handed off. Aborting one frees no step
        # budget (its blocks wait for the decode worker), so preemption no longer picks it.
        self.prompts_computed: set[str] = set()
        self.meter = ThroughputMeter()  # prefill: tokens per busy second, for admission and preemption
        self.pace = TokenPaceMeter(cfg.worker.tpot_window_s)  # decode: time per output token of the streams
        self.tier_rank = {t.name: i for i, t in enumerate(sorted(cfg.tiers, key=lambda t: t.ttft_ms))}
        # The engine's step shape, for the preemption check. The per-request cap and the background
        # step are vLLM's; the sim engine has neither (it schedules waiting prompts by priority).
        vllm = engine.kind == "vllm"
        self.preemption = PreemptionPolicy(cfg.worker.preemption, cfg.worker.max_preemptions,
                                           cfg.engine.max_num_batched_tokens, cfg.engine.prefill_cap() if vllm else 0,
                                           cfg.engine.background_tokens(role) if vllm else 0,
                                           vllm and cfg.engine.hold_background_steps > 0)
        self.claims = ClaimShield()  # set by a preemption: claim only its tiers for a while
        self.room = ClaimRoom(cfg.worker.max_running, cfg.worker.prefill_token_budget, cfg.worker.kv_watermark)
        self.tiers_by_rank = tuple(sorted(self.tier_rank, key=self.tier_rank.__getitem__))
        # The tasks (not request ids) being preempted or handed back: a preempted request can be
        # claimed again, under the same id, before its old task has finished cleaning up.
        self.preempting: set[asyncio.Task] = set()
        self.handing_back: set[asyncio.Task] = set()
        self.cancel_requested: set[asyncio.Task] = set()  # cancelled by this worker, not yet unwound
        self.left_fleet = False  # deregistered for good (its engine failed): no heartbeat may re-register it
        self.reaped_once = False  # the first look for abandoned entries also takes this id's own (reaper.py)
        self.tombstones: dict[str, asyncio.Task] = {}  # request id -> its "client left while queued?" check
        self.counters = {"completed": 0, "failed": 0, "cancelled": 0, "preempted": 0, "reclaimed": 0,
                         "dead_lettered": 0, "fenced": 0, "dropped_late": 0, "handed_back": 0}
        self.timeline, self.metrics = observe.attach(self)  # request events -> Redis timeline, log line, metrics
        self.tier_by_name = {t.name: t for t in cfg.tiers}
        self.stopping = asyncio.Event()
        self.info = WorkerInfo(
            worker_id=self.worker_id, role=role, engine=engine.kind, model=model_name, host=socket.gethostname(),
            pid=os.getpid(), running=0, waiting=0, kv_usage=0.0, started=time.time(), last_seen=0.0,
            max_running=cfg.worker.max_running,
            # The decode claim rule's watermark: placement does not wait for a worker that would not claim.
            kv_watermark=cfg.worker.kv_watermark if role == "decode" else 0.0,
        )
        self.handle: Callable[[Claimed], Awaitable[None]] | None = None
        self.on_start: list[Callable[[], None]] = []  # run inside the event loop once the worker starts

    # -- lifecycle ---------------------------------------------------------

    async def run(self, handle: Callable[[Claimed], Awaitable[None]], install_signals: bool = True) -> None:
        self.handle = handle
        await self.engine.start()
        await ensure_groups(self.redis, self.keys, self.cfg.tier_names, self.stage)
        if self.cfg.worker.cache_view_max_blocks > 0:  # the gateway places by prefix only where a view is kept
            self.info.cache_block_size = self.engine.cache_block_size
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop_requested, sig)
        for hook in self.on_start:
            hook()
        await self._beat()
        log.info("worker %s ready (role=%s engine=%s)", self.worker_id, self.role, self.engine.kind)
        side = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._cancel_loop()),
                asyncio.create_task(watch_engine(self))]
        if self.info.cache_block_size:
            side.append(asyncio.create_task(self._cache_view_loop()))
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for t in side:
                t.cancel()
            # Each step of the way out is bounded: a stop that hangs on one of them would hold the
            # process until its supervisor's SIGKILL, with nothing in the log to say where it hung.
            await bounded_step("the side tasks", asyncio.gather(*side, return_exceptions=True), log)
            try:
                await bounded_step("deregistering", deregister(self.redis, self.keys, self.worker_id), log)
            except (RedisConnectionError, RedisTimeoutError):
                pass
            await bounded_step("the engine's shutdown", self.engine.shutdown(), log)
            await bounded_step("the timeline's last writes", self.timeline.flush(), log)
            await bounded_step("closing Redis", self.redis.aclose(), log)
            log.info("worker %s stopped", self.worker_id)

    def _stop_requested(self, sig: signal.Signals) -> None:
        """SIGTERM/SIGINT: stop claiming and drain; a watchdog ends the process if the stop never completes."""
        if self.stopping.is_set():
            return
        log.info("worker %s stopping (%s): %d request(s) held", self.worker_id, sig.name, len(self.in_flight))
        self.stopping.set()
        # Drain, then up to 10 s handing back, then the bounded steps of the way out.
        limit_s = self.cfg.worker.drain_timeout_s + 10 + EXIT_STEPS * EXIT_STEP_S + 5
        _StopWatchdog(asyncio.get_running_loop(), limit_s).start()

    async def _drain(self) -> None:
        """Graceful scale-in: let held requests finish (bounded by `drain_timeout_s`),
        then hand back what is left: each goes back on its stream as a new entry
        (a decode resumes from the tokens already sent) and the old entry is
        acked, so no entry is left pending on a consumer that is going away."""
        tasks = [t for t, _ in self.in_flight.values()]
        if not tasks:
            return
        log.info("draining %d request(s)", len(tasks))
        await asyncio.wait(tasks, timeout=self.cfg.worker.drain_timeout_s)
        left = list(self.in_flight.items())
        if not left:
            return
        log.warning("drain timed out; handing %d request(s) back", len(left))
        for rid, (task, _claimed) in left:
            self.handing_back.add(task)
            self.cancel(task)
            await self.engine.abort(rid)
        await asyncio.wait([t for _, (t, _) in left], timeout=10)

    async def is_alive(self, worker_id: str) -> bool:
        """Did `worker_id` heartbeat recently (within three periods)?"""
        score = await self.redis.zscore(self.keys.workers, worker_id)
        return score is not None and score >= time.time() - 3 * self.cfg.worker.heartbeat_s

    # -- claiming ------------------------------------------------------------

    def has_room(self) -> bool:
        """Claim only what the engine can start soon; the rest stays in Redis,
        in deadline order, where any worker that frees up can take it (scheduler/claiming.py)."""
        held = len(self.in_flight)
        if self.role == "prefill":
            return self.room.prefill(held, self.prompt_tokens_in_flight)
        return self.room.decode(held, sum(self.local_prefills.values()), self.engine.stats().kv_usage, self._pace_ok())

    def _pace_ok(self) -> bool:
        """The pace rule's verdict for the streams this decode worker holds (scheduler/decode_room.py)."""
        headroom = self.cfg.worker.tpot_headroom
        if headroom <= 0:
            return True  # the pace rule is off
        tightest = min((_request_of(c.message).tpot_ms for _t, c in self.in_flight.values()), default=None)
        return pace_allows(self.pace.seconds_per_token(time.monotonic()), tightest, headroom)

    def prompt_computed(self, request_id: str) -> None:
        """Prefill: the engine finished the request's prompt; only its hand-off is left."""
        self.prompts_computed.add(request_id)

    def local_prefill_done(self, request_id: str) -> None:
        """Decode: a prompt computed here produced its first token; it no longer holds the step budget."""
        self.local_prefills.pop(request_id, None)

    def tokens_per_s(self) -> float:
        return rate_or_prior(self.meter.tokens_per_s(now_ms()), self.cfg.worker.prior_prefill_tokens_per_s)

    async def _maybe_preempt(self) -> None:
        """Fleet-level preemption (see scheduler/preemption.py): abort the least
        urgent prompt this worker holds when the most urgent waiting one would
        otherwise miss its deadline."""
        heads = await self.queues.peek_heads(block_ms=0)
        if not heads:
            return
        head = heads[pick_tier({t: h.deadline_ms for t, h in heads.items()}, self.tiers_by_rank)]
        await self._preempt_for(head.tier, head.deadline_ms, head.prompt_tokens, claimed=False)

    async def _preempt_for(self, tier: str, deadline_ms: int, prompt_tokens: int, claimed: bool = True) -> None:
        """Abort the prompts in the way of a request of `tier` if it would miss its deadline.

        Called for the head of the streams while the worker is full, and for each
        request as it is claimed: the engine gives its step budget to the prompts it
        already runs before a newcomer, whatever their priorities."""
        for victim in self.victims_for(tier, deadline_ms, prompt_tokens, claimed):
            log.info("preempting %s for a %s request due in %d ms", victim, tier, deadline_ms - now_ms())
            self.timeline.emit(victim, "preempted", tier=_request_of(self.in_flight[victim][1].message).tier,
                               for_tier=tier)
            task = self.in_flight[victim][0]
            self.preempting.add(task)
            self.cancel(task)
            await self.engine.abort(victim)

    def victims_for(self, tier: str, deadline_ms: int, prompt_tokens: int, claimed: bool = True) -> list[str]:
        """The prompts to abort for a request of `tier` (scheduler.preemption.victims), in abort order;
        when there are any, the worker shields the request's tiers (scheduler.claiming.ClaimShield)."""
        computing = list(self._computing())
        rank = self.tier_rank.get(tier, 99)
        held = [(self.tier_rank.get(req.tier, 99), req.deadline_ms, len(req.prompt_token_ids), req.preemptions)
                for _rid, req in computing]
        chosen = victims(self.preemption, held, Waiting(rank, deadline_ms, prompt_tokens), now_ms(), self.tokens_per_s,
                         claimed)
        if chosen:
            self.claims.preempted_for(rank, deadline_ms)
        return [computing[i][0] for i in chosen]

    def computing_ranks(self):
        """Tier ranks of the prompts this worker's engine computes (what keeps a shield up)."""
        return (self.tier_rank.get(req.tier, 99) for _rid, req in self._computing())

    def _computing(self):
        """(request id, request) of the prompts this worker's engine is computing and may preempt:
        a prefill worker's, or a decode worker's own (never a stream in progress)."""
        for rid, (task, claimed) in self.in_flight.items():
            if task not in self.preempting and (rid not in self.prompts_computed if self.role == "prefill"
                                                else rid in self.local_prefills):
                yield rid, _request_of(claimed.message)

    def _claimable_tiers(self) -> tuple[str, ...] | None:
        """The tiers the next claim may take from (None = all): those a recent preemption shields."""
        limit = self.claims.max_rank(now_ms())
        return None if limit is None else tuple(self.tiers_by_rank[: limit + 1])

    def cancel(self, task: asyncio.Task) -> None:
        """Cancel a request's task (preemption, hand-back, the client's cancel).

        Python 3.11's asyncio.wait_for, which redis-py awaits inside its commands,
        drops a cancellation that lands just as the awaited call completes (fixed
        in 3.12): the task runs on as if nothing happened (seen: a cancelled decode
        kept streaming). So the task stays in `cancel_requested` until its
        CancelledError reaches `_start`'s handler, and the decode loop checks
        `cancel_pending()` at every chunk. Cancelling again instead could land in
        the middle of the task's own clean-up (a requeue) and break it.
        """
        self.cancel_requested.add(task)
        task.cancel()

    async def tombstone_checked(self, rid: str) -> None:
        """Wait for the answer to "did the client leave while it was queued?", asked when the request
        was claimed: if it did, the calling request's task is cancelled (at this await at the latest).
        A decode worker asks before its engine takes a handed-off prompt's handle: until then it can
        free the prefill engine's blocks itself, while an engine request aborted as it is being
        submitted may leave them to the lease."""
        tombstone = self.tombstones.get(rid)
        if tombstone is not None:
            await asyncio.shield(tombstone)

    def returning_to_queue(self) -> bool:
        """Is the calling request's task being preempted or handed back (its entry goes back to the
        queue, and another attempt serves it)?"""
        me = asyncio.current_task()
        return me in self.preempting or me in self.handing_back

    def cancel_pending(self) -> bool:
        """Was the calling request's task cancelled by this worker (the cancellation still on its way)?"""
        return asyncio.current_task() in self.cancel_requested

    async def _requeue_preempted(self, claimed: Claimed) -> None:
        """Put a preempted request back with its original arrival and deadline (on its tier's
        retry lane, ahead of what arrived after it), then ack the old entry: EDF brings it
        back in turn; only its prefill is recomputed."""
        req = _request_of(claimed.message)
        again_req = dataclasses.replace(req, preemptions=req.preemptions + 1)
        again = (dataclasses.replace(claimed.message, request=again_req)
                 if isinstance(claimed.message, messages.DecodeWork) else again_req)
        await enqueue(self.redis, self.keys, self.stage, again, self.cfg.redis.stream_maxlen, retry=True)
        self.timeline.emit(req.request_id, "requeued", stage=self.stage, tier=req.tier, reason="preempted")
        await self.queues.ack(claimed)
        self.counters["preempted"] += 1

    async def _hand_back(self, claimed: Claimed) -> None:
        """Return a request this worker will not finish to its tier's retry lane as a new entry.
        The same message: a decode takeover finds the tokens already sent in the
        request's output log and resumes from there."""
        msg = claimed.message
        await enqueue(self.redis, self.keys, self.stage, msg, self.cfg.redis.stream_maxlen,  # type: ignore[arg-type]
                      retry=True)
        self.timeline.emit(_request_of(msg).request_id, "requeued", stage=self.stage, reason="drain")
        await self.queues.ack(claimed)
        self.counters["handed_back"] += 1

    async def _reap(self, room: asyncio.Event) -> None:
        """Take over entries of workers that died or stalled, as far as there is room."""
        wc = self.cfg.worker
        limit = wc.max_running - len(self.in_flight)
        got_back = []
        if not self.reaped_once:  # first: what an earlier process under this worker's id left pending
            self.reaped_once = True
            got_back = await reclaim_previous_life(self.queues, limit)
        for got in got_back + await reclaim(self.queues, wc.reclaim_after_s, limit - len(got_back)):
            rid = _request_of(got.claimed.message).request_id
            self.counters["reclaimed"] += 1
            self.timeline.emit(rid, "reclaimed", stage=self.stage, from_worker=got.previous_owner,
                               delivery=got.deliveries)
            if got.deliveries > wc.max_deliveries:
                self.counters["dead_lettered"] += 1
                log.error("%s was delivered %d times without finishing; dead-lettering it", rid, got.deliveries - 1)
                await self.fail(got.claimed, 500, f"request failed on {got.deliveries - 1} workers in a row "
                                                  "(each died or stalled while holding it); moved to the "
                                                  "dead-letter stream", code="poison_request")
                continue
            log.warning("took over %s from %s (delivery %d)", rid, got.previous_owner, got.deliveries)
            self._start(got.claimed, room)

    def _too_late(self, claimed: Claimed) -> bool:
        """A queued request whose tier would rather fail than be served this late.
        Only before any output: a migrating stream is never dropped."""
        msg = claimed.message
        if isinstance(msg, messages.DecodeWork) and msg.kv_handle is not None:
            return False  # prefilled already: its first token is imminent
        req = _request_of(msg)
        tier = self.tier_by_name.get(req.tier)
        return tier is not None and tier.drop_late_ms >= 0 and now_ms() > req.deadline_ms + tier.drop_late_ms

    async def _claim_loop(self) -> None:
        room = asyncio.Event()
        room.set()
        backoff = 0.1
        next_reap = 0.0
        reaps = 0
        while not self.stopping.is_set():
            if time.monotonic() >= next_reap and self.has_room():
                next_reap = time.monotonic() + self.cfg.worker.reclaim_interval_s
                reaps += 1
                try:
                    await self._reap(room)
                    if reaps % 30 == 0:
                        await forget_departed(self.queues, max(60.0, self.cfg.worker.heartbeat_ttl_s))
                except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                    log.warning("reclaim check failed: %s", exc)
            if not self.has_room():
                room.clear()
                if self.preemption.enabled and (self.role == "prefill" or self.local_prefills):
                    try:
                        await self._maybe_preempt()
                    except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                        log.warning("preemption check failed: %s", exc)
                    await _wait_any(room, self.stopping, timeout=RECHECK_S)  # re-check the heads while full
                else:
                    await _wait_any(room, self.stopping, timeout=1.0)
                continue
            tiers = self._claimable_tiers()
            try:
                claimed = await self.queues.claim(block_ms=500, tiers=tiers, take=self.take)
                backoff = 0.1
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("redis unavailable (%s); retrying in %.1fs", exc, backoff)
                await _wait_any(self.stopping, timeout=backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("consumer groups missing (Redis restarted?); recreating")
                await ensure_groups(self.redis, self.keys, self.cfg.tier_names, self.stage)
                continue
            if claimed is None:
                # Only other tiers' entries may be waiting: claim any tier at once if the shield lifts,
                # else look again soon.
                if tiers is not None and not self.claims.found_nothing(self.computing_ranks()):
                    await _wait_any(room, self.stopping, timeout=RECHECK_S)
                continue
            if self.preemption.enabled and needs_prefill(claimed.message):  # it will compete for the step budget
                req = _request_of(claimed.message)
                await self._preempt_for(req.tier, req.deadline_ms, len(req.prompt_token_ids))
            self._start(claimed, room)

    def _hold(self, claimed: Claimed, task: asyncio.Task) -> None:
        """Count a claimed request as held: what the claim rule and preemption see (scheduler/claiming.py)."""
        req = _request_of(claimed.message)
        tokens = len(req.prompt_token_ids)
        self.prompt_tokens_in_flight += tokens
        if self.role == "decode" and needs_prefill(claimed.message):
            self.local_prefills[req.request_id] = tokens
        self.in_flight[req.request_id] = (task, claimed)

    async def _cancel_if_tombstoned(self, rid: str, task: asyncio.Task) -> None:
        try:
            if await self.redis.exists(self.keys.cancelled(rid)):
                log.info("%s was cancelled while queued; dropping it", rid)
                self.cancel(task)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass  # the request's own Redis calls meet the same outage and fail it visibly

    def _release(self, rid: str, task: asyncio.Task, tokens: int) -> None:
        """A request's task has ended (done, failed, cancelled, preempted, handed back): it is held no more."""
        # A requeued request may already be claimed again (same id, a new task): leave its entries.
        if self.in_flight.get(rid, (None,))[0] is task:
            self.in_flight.pop(rid)
            self.local_prefills.pop(rid, None)
            self.prompts_computed.discard(rid)
        self.prompt_tokens_in_flight -= tokens

    def _start(self, claimed: Claimed, room: asyncio.Event) -> None:
        rid = _request_of(claimed.message).request_id
        tokens = len(_request_of(claimed.message).prompt_token_ids)
        observe.claimed(self, self.stage, _request_of(claimed.message), claimed.entry_id)

        async def guarded() -> None:
            me = asyncio.current_task()
            assert me is not None
            # Was it cancelled while queued (the gateway's tombstone)? A prefill waits for the answer:
            # what it makes (KV blocks, a handle) outlives it. A decode asks beside its first steps,
            # saving every request a round trip before its first token: all it makes goes to the
            # client, so a yes cancels it as a cancel message would, before it has done more than start.
            tombstone = asyncio.create_task(self._cancel_if_tombstoned(rid, me))
            self.tombstones[rid] = tombstone
            try:
                if self.role == "prefill":
                    await asyncio.shield(tombstone)
                if self._too_late(claimed):
                    self.counters["dropped_late"] += 1
                    log.info("drop %s: still queued %d ms past its deadline", rid,
                             now_ms() - _request_of(claimed.message).deadline_ms)
                    await self.fail(claimed, 503, "the request waited in the queue past its deadline and its tier "
                                                  "drops late requests rather than serve them late; retry later",
                                    code="deadline_exceeded", dead_letter=False)
                    return
                assert self.handle is not None
                await self.handle(claimed)
                self.counters["completed"] += 1
            except Fenced as exc:
                # Taken over by another worker (we were presumed dead): it owns the entry now.
                self.counters["fenced"] += 1
                log.warning("fenced: %s", exc)
            except asyncio.CancelledError:
                self.cancel_requested.discard(me)  # delivered
                if me in self.preempting:
                    await self._requeue_preempted(claimed)
                elif me in self.handing_back:
                    await self._hand_back(claimed)
                else:
                    self.counters["cancelled"] += 1
                    self.timeline.emit(rid, "cancelled", phase=self.stage)
                    await self.queues.ack(claimed)  # cancelled by the client: nothing left to deliver
            except Exception as exc:  # noqa: BLE001 - one request's failure must not kill the worker
                log.exception("request %s failed", rid)
                self.counters["failed"] += 1
                # The exception's text stays in this worker's log: it may quote internals, never the client's.
                await self.fail(claimed, 500, f"internal error in {self.role} worker {self.worker_id} "
                                              f"({type(exc).__name__}); its log has the details under request id "
                                              f"{rid}", code="internal_error", detail=f"{type(exc).__name__}: {exc}")
            finally:
                tombstone.cancel()
                if self.tombstones.get(rid) is tombstone:
                    del self.tombstones[rid]
                self.preempting.discard(me)
                self.handing_back.discard(me)
                self.cancel_requested.discard(me)
                self._release(rid, me, tokens)
                room.set()

        self._hold(claimed, asyncio.create_task(guarded(), name=f"{self.role}:{rid}"))

    async def fail(self, claimed: Claimed, status: int, message: str, code: str | None = None,
                   dead_letter: bool = True, detail: str | None = None) -> None:
        """End a request with an explicit error frame, record it in the dead-letter
        stream (for a human to look at, with `detail` when the client's message leaves it
        out), and ack it: never drop a request silently. The frame also goes at the end of the
        request's frame log, where a relay that was reconnecting when it was published finds it
        (gateway/resume.py). Retried while Redis is unreachable (a second copy is harmless: the
        gateway takes one terminal frame)."""
        req = _request_of(claimed.message)
        self.timeline.emit(req.request_id, "failed", status=status, reason=code or "error", dead_letter=dead_letter)
        frame = messages.Failed(request_id=req.request_id, seq=1 << 30, status=status, message=message, code=code)
        payload, frames = messages.encode(frame), self.keys.frames(req.request_id)

        async def send() -> None:  # a pipeline is emptied by its execute(): built afresh for each try
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(frames, payload)
            pipe.expire(frames, self.runs.kept_after_final_s)
            pipe.publish(self.keys.tokens(req.request_id), payload)
            if dead_letter:
                pipe.xadd(
                    self.keys.dead,
                    {"id": req.request_id, "stage": self.stage, "worker": self.worker_id, "error": detail or message,
                     "msg": messages.encode(claimed.message)},
                    maxlen=10_000, approximate=True,
                )
            await pipe.execute()

        await ride_out(send, self.cfg.redis.outage_grace_s, f"failing {req.request_id}")
        await self.ack(claimed)

    async def ack(self, claimed: Claimed) -> None:
        """XACK a finished entry (`TierQueues.ack`), retried while Redis is unreachable for up to
        `outage_grace_s` (workers/outage.py): acking again is harmless."""
        await ride_out(lambda: self.queues.ack(claimed), self.cfg.redis.outage_grace_s,
                       f"acking {_request_of(claimed.message).request_id}")

    # -- side loops --------------------------------------------------------------

    async def _beat(self) -> None:
        s = self.engine.stats()
        self.info.running, self.info.waiting, self.info.kv_usage = len(self.in_flight), s.waiting, s.kv_usage
        self.info.running_tokens = self.prompt_tokens_in_flight if self.role == "prefill" else 0
        # Prefill workers measure every prompt; decode workers the prompts they compute
        # themselves (colocated routes), which admission control uses for those routes.
        self.info.tokens_per_s = self.meter.tokens_per_s(now_ms()) or 0.0
        await heartbeat(self.redis, self.keys, self.info, self.cfg.worker.heartbeat_ttl_s)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.worker.heartbeat_s)
            if self.left_fleet:
                return
            try:
                await self._beat()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _cache_view_loop(self) -> None:
        """Mirror the engine's prefix-cache events into the fleet's cache view (skyline/core/cache_view.py).
        A batch that cannot be written is not retried: the view is cleared at the next write and
        rebuilt from what is stored after it. It then lacks blocks the engine holds (a missed
        placement), but never lists a block the engine evicted while Redis was away."""
        wc = self.cfg.worker
        lost = False
        while True:
            await asyncio.sleep(CACHE_VIEW_PERIOD_S)
            delta = self.engine.cache_delta()
            if delta is None and not lost:
                continue
            stored, removed, cleared = (delta.stored, delta.removed, delta.cleared) if delta else ([], [], False)
            try:
                await cache_view.apply(self.redis, self.keys, self.worker_id, stored, removed, cleared or lost,
                                       wc.cache_view_max_blocks, wc.heartbeat_ttl_s)
                lost = False
            except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                if not lost:
                    log.warning("cache view not updated (%s); it is rebuilt once Redis answers", exc)
                lost = True

    async def _cancel_loop(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel)
                async for msg in pubsub.listen():
                    cancel = messages.decode(msg["data"])
                    if isinstance(cancel, messages.Cancel) and cancel.request_id in self.in_flight:
                        log.info("cancel %s (%s)", cancel.request_id, cancel.reason)
                        self.cancel(self.in_flight[cancel.request_id][0])
                        await self.engine.abort(cancel.request_id)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()


def _request_of(msg: messages.Message) -> messages.GenerateRequest:
    return msg.request if isinstance(msg, messages.DecodeWork) else msg  # type: ignore[return-value]


CACHE_VIEW_PERIOD_S = 0.05  # how often the engine's cache events are mirrored into Redis (one pipeline)
EXIT_STEPS = 5  # the awaited steps after the drain, each bounded by EXIT_STEP_S
EXIT_STEP_S = STOP_STEP_S


class _StopWatchdog(threading.Thread):
    """Ends a worker whose stop has not completed in `limit_s`: logs every asyncio task's stack
    and every thread's (where it hung), then exits with status 1. A thread, so a blocked event
    loop cannot hold it up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float):
        super().__init__(name="stop-watchdog", daemon=True)
        self.loop, self.limit_s = loop, limit_s

    def run(self) -> None:
        time.sleep(self.limit_s)
        log.error("worker did not stop within %.0f s of the signal; exiting (stacks follow)", self.limit_s)
        try:
            self.loop.call_soon_threadsafe(_print_task_stacks)
        except RuntimeError:
            pass  # the loop is closed: the thread stacks below say the rest
        time.sleep(1.0)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(1)


def _print_task_stacks() -> None:
    # Each task's chain of awaits, outermost first: the last line is where it waits.
    for task in asyncio.all_tasks():
        print(f"task {task.get_name()}:", file=sys.stderr)
        coro = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=sys.stderr)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


async def _wait_any(*events: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
