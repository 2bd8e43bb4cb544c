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

Each held request is one record (workers/held.py) whose transitions this runtime
owns; what differs by role is a small rules object (workers/roles.py), and the
role's work is a `handle(held)` coroutine (prefill.py, decode.py) that sees the
worker through a narrow port (workers/port.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from skyline.core import messages, redisconn
from skyline.core.config import SkylineConfig
from skyline.core.fleet import WorkerInfo, deregister, heartbeat, list_workers, read_worker
from skyline.core.keys import Keys, keyspace_of
from skyline.core.stopping import STOP_STEP_S, bounded_step
from skyline.core.stage_queues import StageQueues
from skyline.core.streams import Head, TierQueues, enqueue, ensure_groups, now_ms, open_lanes, queued_tokens
from skyline.scheduler.claiming import (NO_PEERS, RECHECK_S, ClaimRoom, ClaimShield, FreestPeers, claim_defer_s,
                                        computes_long, freest_peers, leaves_until_due, long_prompt_defer_s,
                                        tokens_left)
from skyline.scheduler.decode_room import TokenPaceMeter, pace_allows, tightest_target_ms
from skyline.scheduler.edf import pick_tier
from skyline.scheduler.elastic import MixWindow, decoder_for, handoff_step_tokens, has_room, long_engines
from skyline.scheduler.preemption import PreemptionPolicy, Waiting, victims
from skyline.scheduler.throughput import ThroughputMeter, rate_or_prior
from skyline.workers import observe
from skyline.workers.adapters import AdapterKeeper
from skyline.workers.cache_mirror import mirror_cache
from skyline.workers.engine_watch import watch_engine
from skyline.workers.engines.base import Engine
from skyline.workers.held import Exit, Fenced, HeldRequest, HeldTable
from skyline.workers.outage import ride_out
from skyline.workers.port import WorkerPort
from skyline.workers.reaper import forget_departed, reclaim, reclaim_previous_life
from skyline.workers.roles import rules_of
from skyline.workers.runs import Runs
from skyline.workers.stop_watchdog import StopWatchdog

log = logging.getLogger("skyline.worker")

__all__ = ["Fenced", "WorkerRuntime"]  # Fenced lives in workers/held.py; re-exported for the handlers' callers

Handler = Callable[[HeldRequest], Awaitable[None]]


class WorkerRuntime:
    def __init__(self, cfg: SkylineConfig, engine: Engine, model_name: str, model_path: str = ""):
        self.rules = rules_of(cfg.worker.role)
        role = self.rules.name
        self.cfg = cfg
        self.engine = engine
        self.role = role
        self.stages = self.rules.stages
        # Its model's queues: the plain keys for the fleet's default model, else keys named after it.
        self.keys = Keys(cfg.key_prefix, keyspace_of(model_name, cfg.default_model))
        self.worker_id = cfg.worker.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        self.redis = redisconn.connect(cfg.redis, socket_keepalive=True, health_check_interval=10)
        # One stage's tier streams, or both an elastic worker consumes, claimed in one EDF order.
        self.stage_queues = [TierQueues(self.redis, self.keys, s, cfg.tiers, self.worker_id,
                                        liveness_s=cfg.worker.reclaim_after_s) for s in self.stages]
        self.queues: TierQueues | StageQueues = (
            self.stage_queues[0] if len(self.stage_queues) == 1
            else StageQueues({q.stage: q for q in self.stage_queues}))
        self.runs = Runs(self.redis, self.keys, cfg.redis.run_ttl_s, cfg.redis.outage_grace_s)
        # A decode claim takes the entry and its request's run in one round trip (workers/runs.py).
        self.take = functools.partial(self.runs.take, worker_id=self.worker_id) if "decode" in self.stages else None
        self.elastic = len(self.stages) > 1  # takes either phase: decides per prompt where it decodes
        # Long prompts gather on engines (scheduler/claiming.py `leaves_until_due`): the fleet's phase mix
        # (scheduler/elastic.py `long_engines`), else the memory form where configured; elastic workers only.
        self.phase_mix = self.elastic and cfg.worker.phase_mix
        self.gathers_long = self.elastic and (self.phase_mix or cfg.worker.long_prompt_memory_s > 0)
        self.last_long_s: float | None = None  # when its engine last computed a long prompt (`_computes_long`)
        self.mix = MixWindow()  # the prompt tokens it claimed lately, long and short (its heartbeat's)
        self.long_set: frozenset[str] = frozenset()  # the engines that keep the long prompts (`see_peers`)
        self.peers: list[WorkerInfo] = []  # the live workers, as of the last heartbeat (elastic placement)
        self.freest: FreestPeers = NO_PEERS  # the peers that free their engines first, of `peers` (claim defer)
        self._announcing: set[asyncio.Task] = set()  # heartbeats between beats (`_announce`)
        self.prefill_backlog = 0  # prompt tokens queued or computing for the prefill stage, same age
        self.held = HeldTable()  # every request this worker holds, one record each (workers/held.py)
        self.meter = ThroughputMeter()  # prompt tokens per busy second of the prompts computed here
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
        self.left_fleet = False  # deregistered for good (its engine failed): no heartbeat may re-register it
        self.reaped_once = False  # the first look for abandoned entries also takes this id's own (reaper.py)
        self.counters = {e.value: 0 for e in Exit} | {"reclaimed": 0, "dead_lettered": 0}
        self.timeline, self.metrics = observe.attach(self)  # request events -> Redis timeline, log line, metrics
        self.tier_by_name = {t.name: t for t in cfg.tiers}
        self.stopping = asyncio.Event()
        self.info = WorkerInfo(
            worker_id=self.worker_id, role=role, engine=engine.kind, model=model_name, host=socket.gethostname(),
            pid=os.getpid(), running=0, waiting=0, kv_usage=0.0, started=time.time(), last_seen=0.0,
            max_running=cfg.worker.max_running,
            kv_watermark=cfg.worker.kv_watermark if self.rules.has_kv_watermark else 0.0,
            keyspace=self.keys.model, model_path=model_path,
        )
        self.handlers: dict[str, Handler] = {}  # what each stage's work is served by (held.serve_as)
        self.adapter_keeper = AdapterKeeper(engine, self.redis, self.keys, self.info)
        self.on_start: list[Callable[[], None]] = []  # run inside the event loop once the worker starts
        self.port = WorkerPort(cfg=cfg, worker_id=self.worker_id, keys=self.keys, redis=self.redis, engine=engine,
                               runs=self.runs, timeline=self.timeline, meter=self.meter, pace=self.pace,
                               fail=self.fail, ack=self.ack, release_prefill=self.release_prefill,
                               is_alive=self.is_alive, on_start=self.on_start)

    # -- lifecycle ---------------------------------------------------------

    async def run(self, handle: Handler | Mapping[str, Handler], install_signals: bool = True) -> None:
        """Serve until stopped. `handle`: the role's handler, or one per stage's work ("prefill", "decode")."""
        self.handlers = dict(handle) if isinstance(handle, Mapping) else {s: handle for s in self.stages}
        await self.engine.start()
        self.info.max_model_len = self.engine.max_model_len
        await self._ensure_groups()
        if self.elastic:  # its lanes exist before any peer places a hand-off there: watched from the start
            await open_lanes(self.redis, self.keys, "decode", self.cfg.tier_names, self.worker_id)
        if self.cfg.worker.cache_view_max_blocks > 0:  # the gateway places by prefix only where a view is kept
            self.info.cache_block_size = self.engine.cache_block_size
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop_requested, sig)
        for hook in self.on_start:
            hook()
        await self.adapter_keeper.start()  # its --lora-modules, in the fleet's registry (workers/adapters.py)
        await self._beat()
        log.info("worker %s ready (role=%s engine=%s)", self.worker_id, self.role, self.engine.kind)
        side = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._cancel_loop()),
                asyncio.create_task(watch_engine(self)),
                asyncio.create_task(self.adapter_keeper.serve_checks())]  # adapter paths a gateway asks about
        if self.info.cache_block_size:
            side.append(asyncio.create_task(
                mirror_cache(self.engine, self.redis, self.keys, self.worker_id, self.cfg.worker)))
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            side += self._announcing  # a beat still on its way must not land after the deregistration
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
        log.info("worker %s stopping (%s): %d request(s) held", self.worker_id, sig.name, len(self.held))
        self.stopping.set()
        # Drain, then up to 10 s handing back, then the bounded steps of the way out.
        limit_s = self.cfg.worker.drain_timeout_s + 10 + EXIT_STEPS * EXIT_STEP_S + 5
        StopWatchdog(asyncio.get_running_loop(), limit_s).start()

    async def _drain(self) -> None:
        """Graceful scale-in: let held requests finish (bounded by `drain_timeout_s`),
        then hand back what is left: each goes back on its stream as a new entry
        (a decode resumes from the tokens already sent) and the old entry is
        acked, so no entry is left pending on a consumer that is going away."""
        tasks = [h.task for h in self.held if h.task is not None]
        if not tasks:
            return
        log.info("draining %d request(s)", len(tasks))
        await asyncio.wait(tasks, timeout=self.cfg.worker.drain_timeout_s)
        left = list(self.held)
        if not left:
            return
        log.warning("drain timed out; handing %d request(s) back", len(left))
        for held in left:
            held.end_early(Exit.HANDED_BACK)
            await self.engine.abort(held.request_id)
        await asyncio.wait([h.task for h in left if h.task is not None], timeout=10)

    async def is_alive(self, worker_id: str) -> bool:
        """Did `worker_id` heartbeat recently (within three periods)?"""
        score = await self.redis.zscore(self.keys.workers, worker_id)
        return score is not None and score >= time.time() - 3 * self.cfg.worker.heartbeat_s

    # -- claiming ------------------------------------------------------------

    def has_room(self) -> bool:
        """Claim only what the engine can start soon; the rest stays in Redis,
        in deadline order, where any worker that frees up can take it (scheduler/claiming.py)."""
        return self.rules.has_room(self.room, self.held, lambda: self.engine.stats().kv_usage, self._pace_ok)

    def paced_out(self) -> bool:
        """Full by the pace rule alone (scheduler/decode_room.py): its streams run slower than their targets
        allow one more, while the count, the prompt budget and the KV watermark would let it claim."""
        return not self._pace_ok() and self.rules.has_room(self.room, self.held,
                                                           lambda: self.engine.stats().kv_usage, lambda: True)

    def _claim_defer(self, head: Head) -> float:
        """Seconds to wait before claiming `head`, so that a peer free sooner takes it first
        (scheduler/claiming.py `claim_defer_s`): the tokens its engine has left against the freest peer's, as
        their last heartbeats said. The wait ends early when one of its prompts frees the step budget
        (`HeldTable.freed`, passed to the claim)."""
        if not head.prefill_tokens or self.cfg.worker.claim_defer_max_s <= 0:
            return 0.0
        if not self.held.computing_prompts():
            if not self.elastic or head.stage != "prefill":
                return 0.0
            return long_prompt_defer_s(self._streams(), self.freest.fewest_streams(self.worker_id, "prefill"),
                                       self.cfg.worker.claim_defer_max_s)
        peer_free_s = self.freest.free_s(self.worker_id, head.stage or self.stages[0], time.time())
        if peer_free_s is None:
            return 0.0  # no peer would take it sooner (the rate is not asked for when there is nothing to decide)
        rate = self.tokens_per_s()
        return claim_defer_s(head.prefill_tokens, self.tier_rank.get(head.tier, 99), self._left_tokens(rate),
                             self.computing_ranks(), rate, peer_free_s, self.cfg.worker.claim_defer_max_s)

    def _left_tokens(self, rate: float) -> int:
        """Prompt tokens its engine has yet to compute, at `rate` where the engine does not tell
        (scheduler/claiming.py `tokens_left`): what its claim defer weighs, and its heartbeat tells its peers'."""
        return tokens_left([(h.prompt_tokens, h.claimed_s, self.engine.computed_tokens(h.request_id))
                            for h in self.held.computing_prompts()], rate, time.monotonic())

    def see_peers(self, peers: list[WorkerInfo]) -> None:
        """The live workers as their heartbeats say (read once per beat): what elastic placement and the
        claim defer read until the next."""
        self.peers = peers
        wc = self.cfg.worker
        self.freest = freest_peers(peers, wc.prefill_token_budget, wc.prior_prefill_tokens_per_s)
        if self.phase_mix:
            self.long_set = long_engines(peers, self.long_set)

    def _pace_ok(self) -> bool:
        """The pace rule's verdict for the streams this worker decodes (scheduler/decode_room.py)."""
        headroom = self.cfg.worker.tpot_headroom
        if headroom <= 0:
            return True  # the pace rule is off
        tightest = tightest_target_ms((h.request.tpot_ms, h.request.best_effort) for h in self.held)
        return pace_allows(self.pace.seconds_per_token(time.monotonic()), tightest, headroom)

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
            held = self.held.get(victim)
            assert held is not None
            log.info("preempting %s for a %s request due in %d ms", victim, tier, deadline_ms - now_ms())
            self.timeline.emit(victim, "preempted", tier=held.request.tier, for_tier=tier)
            held.end_early(Exit.PREEMPTED)
            await self.engine.abort(victim)

    def victims_for(self, tier: str, deadline_ms: int, prompt_tokens: int, claimed: bool = True) -> list[str]:
        """The prompts to abort for a request of `tier` (scheduler.preemption.victims), in abort order;
        when there are any, the worker shields the request's tiers (scheduler.claiming.ClaimShield)."""
        computing = self.held.computing()
        rank = self.tier_rank.get(tier, 99)
        held = [(self.tier_rank.get(h.request.tier, 99), h.request.deadline_ms, h.prompt_tokens,
                 h.request.preemptions) for h in computing]
        chosen = victims(self.preemption, held, Waiting(rank, deadline_ms, prompt_tokens), now_ms(), self.tokens_per_s,
                         claimed)
        if chosen:
            self.claims.preempted_for(rank, deadline_ms)
        return [computing[i].request_id for i in chosen]

    def computing_ranks(self):
        """Tier ranks of the prompts this worker's engine computes (what keeps a shield up)."""
        return (self.tier_rank.get(h.request.tier, 99) for h in self.held.computing())

    def _claimable_tiers(self) -> tuple[str, ...] | None:
        """The tiers the next claim may take from (None = all): those a recent preemption shields."""
        limit = self.claims.max_rank(now_ms())
        return None if limit is None else tuple(self.tiers_by_rank[: limit + 1])

    async def _requeue_preempted(self, held: HeldRequest) -> None:
        """Put a preempted request back with its original arrival and deadline (on its tier's
        retry lane, ahead of what arrived after it), then ack the old entry: EDF brings it
        back in turn; only its prefill is recomputed."""
        req, msg = held.request, held.claimed.message
        again_req = dataclasses.replace(req, preemptions=req.preemptions + 1)
        again = (dataclasses.replace(msg, request=again_req) if isinstance(msg, messages.DecodeWork) else again_req)
        await enqueue(self.redis, self.keys, held.stage, again, self.cfg.redis.stream_maxlen, retry=True)
        self.timeline.emit(req.request_id, "requeued", stage=held.stage, tier=req.tier, reason="preempted")
        await self.queues.ack(held.claimed)

    async def _hand_back(self, held: HeldRequest) -> None:
        """Return a request this worker will not finish to its tier's retry lane as a new entry.
        The same message: a decode takeover finds the tokens already sent in the
        request's output log and resumes from there."""
        await enqueue(self.redis, self.keys, held.stage, held.claimed.message,  # type: ignore[arg-type]
                      self.cfg.redis.stream_maxlen, retry=True)
        self.timeline.emit(held.request_id, "requeued", stage=held.stage, reason="drain")
        await self.queues.ack(held.claimed)

    async def _reap(self, room: asyncio.Event) -> None:
        """Take over entries of workers that died or stalled, as far as there is room."""
        wc = self.cfg.worker
        got_back = []
        first = not self.reaped_once
        self.reaped_once = True
        for queues in self.stage_queues:
            if first:  # first: what an earlier process under this worker's id left pending
                got_back += await reclaim_previous_life(queues, wc.max_running - len(self.held) - len(got_back))
            got_back += await reclaim(queues, wc.reclaim_after_s, wc.max_running - len(self.held) - len(got_back))
        for got in got_back:
            held = HeldRequest.of(got.claimed, self.rules.first_phase(got.claimed.message))
            self.counters["reclaimed"] += 1
            self.timeline.emit(held.request_id, "reclaimed", stage=held.stage, from_worker=got.previous_owner,
                               delivery=got.deliveries)
            if got.deliveries > wc.max_deliveries:
                self.counters["dead_lettered"] += 1
                log.error("%s was delivered %d times without finishing; dead-lettering it", held.request_id,
                          got.deliveries - 1)
                await self.fail(held, 500, f"request failed on {got.deliveries - 1} workers in a row "
                                           "(each died or stalled while holding it); moved to the "
                                           "dead-letter stream", code="poison_request")
                continue
            log.warning("took over %s from %s (delivery %d)", held.request_id, got.previous_owner, got.deliveries)
            self._start(held, room)

    def _too_late(self, held: HeldRequest) -> bool:
        """A queued request whose tier would rather fail than be served this late.
        Only before any output: a migrating stream is never dropped."""
        msg = held.claimed.message
        if isinstance(msg, messages.DecodeWork) and msg.kv_handle is not None:
            return False  # prefilled already: its first token is imminent
        if held.request.best_effort:
            return False  # it asked for no SLO: served however late, as `vllm serve` would
        tier = self.tier_by_name.get(held.request.tier)
        return tier is not None and tier.drop_late_ms >= 0 and now_ms() > held.request.deadline_ms + tier.drop_late_ms

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
                        for queues in self.stage_queues:
                            await forget_departed(queues, max(60.0, self.cfg.worker.heartbeat_ttl_s))
                except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                    log.warning("reclaim check failed: %s", exc)
            due_by_ms = None  # claim only a head that must start by then (None: any head)
            if not self.has_room():
                room.clear()
                if self.preemption.enabled and self.held.computing():
                    try:
                        await self._maybe_preempt()
                    except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                        log.warning("preemption check failed: %s", exc)
                if self.paced_out():
                    # The pace rule keeps new work off this engine to keep its streams on target, but
                    # holds a request back no longer than its latest start: past it, waiting makes that
                    # request miss for certain (scheduler/decode_room.py). Looked at as a full worker's
                    # heads are, every RECHECK_S.
                    due_by_ms = now_ms()
                elif self.preemption.enabled and self.held.computing():
                    await _wait_any(room, self.stopping, timeout=RECHECK_S)  # re-check the heads while full
                    continue
                else:
                    await _wait_any(room, self.stopping, timeout=1.0)
                    continue
            tiers = self._claimable_tiers()
            try:
                # (a head due to start now is not left to a peer: waiting would make it late)
                claimed = await self.queues.claim(block_ms=0 if due_by_ms else 500, tiers=tiers, take=self.take,
                                                  defer=None if due_by_ms else self._claim_defer, wake=self.held.freed,
                                                  tokens_per_s=self.tokens_per_s(), due_by_ms=due_by_ms,
                                                  **({"leave": self._leaves} if self.gathers_long else {}))
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
                await self._ensure_groups()
                continue
            if claimed is None:
                if due_by_ms is not None or (self.gathers_long and self.queues.left_heads):  # type: ignore[union-attr]
                    # Paced out, or heads left to peers (`_leaves`), and none due to start yet: look again soon.
                    await _wait_any(room, self.stopping, timeout=RECHECK_S)
                    continue
                # Only other tiers' entries may be waiting: claim any tier at once if the shield lifts,
                # else look again soon.
                if tiers is not None and not self.claims.found_nothing(self.computing_ranks()):
                    await _wait_any(room, self.stopping, timeout=RECHECK_S)
                continue
            held = HeldRequest.of(claimed, self.rules.first_phase(claimed.message))
            if self.preemption.enabled and held.computing:  # it will compete for the step budget
                await self._preempt_for(held.request.tier, held.request.deadline_ms, held.prompt_tokens)
            self._start(held, room)

    def _leaves(self, stage: str, head: Head, start_by_ms: int, due: bool) -> bool:
        """Does this elastic worker leave `head` of `stage` (latest start `start_by_ms`; `due`: that time has
        come) to its peers (scheduler/claiming.py `leaves_until_due`): a short prompt while long prompts
        gather on its engine, to a peer where they do not, free by then; a long prompt while they gather
        on a peer's free by then and not here? Asked at each look at the heads, a claim that blocks for
        an entry included: the state it weighs may change meanwhile."""
        if not head.prefill_tokens:
            return False  # (a KV hand-off: nothing to weigh)
        me, peers = self.worker_id, self.freest
        return leaves_until_due(stage, head.prefill_tokens, start_by_ms / 1000, long_here=self._computes_long(),
                                held_here=len(self.held),
                                free_at_with_long=peers.free_at_with_long(me, "prefill"),
                                without_long=peers.least_held_without_long(me, "decode"), due=due,
                                split=self.phase_mix, idle_here=not self.held)

    def _computes_long(self) -> bool:
        """Do long prompts (the prefill stage's) gather on this engine: is it one of the fleet's phase mix's
        long engines (scheduler/elastic.py `long_engines`), or, with that off, one that computed a long
        prompt lately (scheduler/claiming.py `computes_long`)?"""
        if self.phase_mix:
            return self.worker_id in self.long_set
        if not self.gathers_long:
            return False
        now = time.monotonic()
        if any(h.stage == "prefill" for h in self.held.computing_prompts()):
            self.last_long_s = now
        return computes_long(self.last_long_s, now, self.cfg.worker.long_prompt_memory_s)

    def _streams(self) -> int:
        """Requests it decodes, or will (held to be served as decode work): what placing a decode and the
        long-prompt defer weigh."""
        return sum(1 for h in self.held if h.serve_as == "decode")

    def _place_decode(self, held: HeldRequest) -> None:
        """An elastic worker's prompt from the prefill streams: decode it here (served whole, no KV
        moves) or on a peer (computed here, its KV handed to that peer): scheduler/elastic.py."""
        mine = sum(h.prompt_tokens for h in self.held if h.stage == "prefill") + held.claimed.prefill_tokens
        streams = self._streams()
        peer, why = decoder_for(self.worker_id, streams, self.peers, self.prefill_backlog > mine,
                                self.cfg.worker.prefill_token_budget, spread=held.request_id,
                                step_tokens=self.cfg.engine.max_num_batched_tokens,
                                prompt_tokens=held.prompt_tokens,
                                min_move_tokens=self.cfg.gateway.min_remote_prefill_tokens,
                                long_here=self.long_set)
        held.serve_as, held.decode_on = ("prefill", peer) if peer else ("decode", None)
        held.decode_placed = why
        self.timeline.emit(held.request_id, "decode_placed", on=peer or self.worker_id, why=why, streams_here=streams)

    async def _ensure_groups(self) -> None:
        for stage in self.stages:
            await ensure_groups(self.redis, self.keys, self.cfg.tier_names, stage)

    def hold(self, held: HeldRequest, task: asyncio.Task) -> None:
        """Count a claimed request as held from now: what the claim rule and preemption see."""
        held.task = task
        held.claimed_s = time.monotonic()
        self.held.add(held)

    async def _cancel_if_tombstoned(self, held: HeldRequest) -> None:
        try:
            if await self.redis.exists(self.keys.cancelled(held.request_id)):
                log.info("%s was cancelled while queued; dropping it", held.request_id)
                held.end_early(Exit.CANCELLED)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass  # the request's own Redis calls meet the same outage and fail it visibly

    def _start(self, held: HeldRequest, room: asyncio.Event) -> None:
        observe.claimed(self, held.stage, held.request, held.claimed.entry_id)
        if self.elastic and held.stage == "prefill":
            self._place_decode(held)
        if self.phase_mix and held.computing:
            self.mix.add(time.monotonic(), held.prompt_tokens, long=held.stage == "prefill")
        self.hold(held, asyncio.create_task(self._serve(held, room), name=f"{self.role}:{held.request_id}"))
        if held.computing and self.reads_peers:
            # Its peers place hand-offs and defer claims on this worker's heartbeat: a prompt it starts
            # now changes both, and a beat can be a second away (`_announce`).
            task = asyncio.create_task(self._announce())
            self._announcing.add(task)
            task.add_done_callback(self._announcing.discard)

    async def _confirm_decoder(self, held: HeldRequest) -> None:
        """Check the peer a hand-off was placed for (`_place_decode`, on views up to two beats old) on its
        newest heartbeat before computing the prompt for it: a peer that has started prompts of its own
        since would start the pull only after them (`elastic.has_room`; seen on the mixed chat + RAG
        benchmark: chats handed to a peer that had just claimed a 1,500-token prompt waited 1.5-5 s for
        their KV). Then the prompt is decoded here, as when no peer has room."""
        try:
            peer = await read_worker(self.redis, self.keys, held.decode_on or "")
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return  # the hand-off's own Redis calls meet the same outage
        if peer is None or not has_room(peer, self.cfg.worker.prefill_token_budget,
                                        handoff_step_tokens(held.decode_placed,
                                                            self.cfg.engine.max_num_batched_tokens)):
            held.serve_as, held.decode_on, held.decode_placed = "decode", None, "peer_busy_now"
            self.timeline.emit(held.request_id, "decode_placed", on=self.worker_id, why="peer_busy_now",
                               streams_here=self._streams())

    async def _serve(self, held: HeldRequest, room: asyncio.Event) -> None:
        """One held request's task, from its claim to its release: the role's handler, and what each
        way of leaving means for its entry (WorkerRuntime owns every transition of the record)."""
        rid = held.request_id
        held.tombstone = asyncio.create_task(self._cancel_if_tombstoned(held))
        try:
            if held.decode_on:
                await self._confirm_decoder(held)
            if held.serve_as == "prefill":
                # What a prefill makes (KV blocks, a handle) outlives it: ask first. A decode asks beside
                # its first steps, saving every request a round trip before its first token: all it makes
                # goes to the client, so a yes cancels it as a cancel message would.
                await asyncio.shield(held.tombstone)
            if self._too_late(held):
                self._count(Exit.DROPPED_LATE)
                log.info("drop %s: still queued %d ms past its deadline", rid, now_ms() - held.request.deadline_ms)
                await self.fail(held, 503, "the request waited in the queue past its deadline and its tier "
                                           "drops late requests rather than serve them late; retry later",
                                code="deadline_exceeded", dead_letter=False)
                return
            await self.handlers[held.serve_as](held)
            self._count(Exit.COMPLETED)
        except Fenced as exc:
            # Taken over by another worker (we were presumed dead): it owns the entry now.
            self._count(Exit.FENCED)
            log.warning("fenced: %s", exc)
        except asyncio.CancelledError:
            held.cancel_delivered = True
            if held.leaving is Exit.PREEMPTED:
                await self._requeue_preempted(held)
                self._count(Exit.PREEMPTED)
            elif held.leaving is Exit.HANDED_BACK:
                await self._hand_back(held)
                self._count(Exit.HANDED_BACK)
            else:
                self._count(Exit.CANCELLED)
                self.timeline.emit(rid, "cancelled", phase=held.stage)
                await self.queues.ack(held.claimed)  # cancelled by the client: nothing left to deliver
        except Exception as exc:  # noqa: BLE001 - one request's failure must not kill the worker
            log.exception("request %s failed", rid)
            self._count(Exit.FAILED)
            # The exception's text stays in this worker's log: it may quote internals, never the client's.
            await self.fail(held, 500, f"internal error in {self.role} worker {self.worker_id} "
                                       f"({type(exc).__name__}); its log has the details under request id "
                                       f"{rid}", code="internal_error", detail=f"{type(exc).__name__}: {exc}")
        finally:
            held.tombstone.cancel()
            self.held.release(held)
            room.set()

    def _count(self, how: Exit) -> None:
        self.counters[how.value] += 1

    async def fail(self, held: HeldRequest, status: int, message: str, code: str | None = None,
                   dead_letter: bool = True, detail: str | None = None) -> None:
        """End a request with an explicit error frame, record it in the dead-letter
        stream (for a human to look at, with `detail` when the client's message leaves it
        out), and ack it: never drop a request silently. The frame also goes at the end of the
        request's frame log, where a relay that was reconnecting when it was published finds it
        (gateway/resume.py). Retried while Redis is unreachable (a second copy is harmless: the
        gateway takes one terminal frame)."""
        rid = held.request_id
        self.timeline.emit(rid, "failed", status=status, reason=code or "error", dead_letter=dead_letter)
        frame = messages.Failed(request_id=rid, seq=1 << 30, status=status, message=message, code=code)
        payload, frames = messages.encode(frame), self.keys.frames(rid)

        async def send() -> None:  # a pipeline is emptied by its execute(): built afresh for each try
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(frames, payload)
            pipe.expire(frames, self.runs.kept_after_final_s)
            pipe.publish(self.keys.tokens(rid), payload)
            if dead_letter:
                pipe.xadd(
                    self.keys.dead,
                    {"id": rid, "stage": held.stage, "worker": self.worker_id, "error": detail or message,
                     "msg": messages.encode(held.claimed.message)},
                    maxlen=10_000, approximate=True,
                )
            await pipe.execute()

        await ride_out(send, self.cfg.redis.outage_grace_s, f"failing {rid}")
        await self.ack(held)

    async def ack(self, held: HeldRequest) -> None:
        """XACK a finished entry (`TierQueues.ack`), retried while Redis is unreachable for up to
        `outage_grace_s` (workers/outage.py): acking again is harmless."""
        await ride_out(lambda: self.queues.ack(held.claimed), self.cfg.redis.outage_grace_s,
                       f"acking {held.request_id}")

    async def release_prefill(self, held: HeldRequest) -> None:
        """Its prompt was computed here before its ack: take it off the prefill backlog now."""
        await ride_out(lambda: self.queues.release_prefill(held.claimed), self.cfg.redis.outage_grace_s,
                       "releasing a prefill")

    # -- side loops --------------------------------------------------------------

    @property
    def reads_peers(self) -> bool:
        """Does it read its peers' heartbeats (elastic placement, the claim defer), and they its?"""
        return self.elastic or self.cfg.worker.claim_defer_max_s > 0

    def _fill_info(self) -> None:
        s = self.engine.stats()
        self.info.running, self.info.waiting, self.info.kv_usage = len(self.held), s.waiting, s.kv_usage
        self.info.running_tokens = self.rules.running_tokens(self.held)
        self.info.left_tokens = self._left_tokens(self.tokens_per_s()) if self.held.computing_prompts() else 0
        self.info.computes_long = int(self._computes_long())
        self.info.long_tokens, self.info.short_tokens = self.mix.totals(time.monotonic())
        # Prefill workers measure every prompt; decode workers the prompts they compute
        # themselves (colocated routes), which admission control uses for those routes.
        self.info.tokens_per_s = self.meter.tokens_per_s(now_ms()) or 0.0

    async def _announce(self) -> None:
        """Heartbeat now, between beats: the load numbers only (one pipelined write)."""
        if self.left_fleet:
            return  # deregistered: a beat now would announce a worker that is gone
        try:
            self._fill_info()
            await heartbeat(self.redis, self.keys, self.info, self.cfg.worker.heartbeat_ttl_s)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass  # the next beat retries

    async def _beat(self) -> None:
        self._fill_info()
        await self.adapter_keeper.beat()  # the adapters its engine holds; those unloaded from the fleet dropped
        await heartbeat(self.redis, self.keys, self.info, self.cfg.worker.heartbeat_ttl_s)
        if self.reads_peers:
            # What placing a prompt's decode (`_place_decode`) and the claim defer read, as fresh as the heartbeat.
            # Its own model's workers only: another model's engines cannot take this model's prompts.
            self.see_peers([w for w in await list_workers(self.redis, self.keys, 3 * self.cfg.worker.heartbeat_s)
                            if w.model == self.info.model and w.keyspace == self.info.keyspace])
        if self.elastic:
            self.prefill_backlog = sum((await queued_tokens(self.redis, self.keys, "prefill")).values())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.worker.heartbeat_s)
            if self.left_fleet:
                return
            try:
                await self._beat()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _cancel_loop(self) -> None:
        """Abort the requests this worker holds whose clients left (the gateway's `Cancel` messages)."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel)
                async for msg in pubsub.listen():
                    cancel = messages.decode(msg["data"])
                    held = self.held.get(cancel.request_id) if isinstance(cancel, messages.Cancel) else None
                    if held is not None:
                        log.info("cancel %s (%s)", cancel.request_id, cancel.reason)
                        held.end_early(Exit.CANCELLED)
                        await self.engine.abort(cancel.request_id)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()


EXIT_STEPS = 5  # the awaited steps after the drain, each bounded by EXIT_STEP_S
EXIT_STEP_S = STOP_STEP_S


async def _wait_any(*events: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
