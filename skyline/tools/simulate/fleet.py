"""One simulated fleet: gateway, tier streams, prefill and decode workers, on one virtual clock.

The gateway does what `gateway/prepare.py`, `gateway/app.py` and
`gateway/admission.py` do with each request, calling the same policy:
`resolve_slo` (tier and targets; the client's per-class targets arrive as
x-slo-ttft-ms / x-slo-tpot-ms headers, as `skyline bench` sends them),
`route` (with the prefill backlog the gateway's FleetView cached at its last
refresh), and `scheduler.admission.decide` (`admit` on the backlog of the request's
stage and tier, the prefill throughput of the live pool from the workers' heartbeats via
`pool_rate`, the calibration's scale), `demoted` and `learn_ttft`. A refused request is
a 429, as in the bench.

Workers waiting for work queue in arrival order, as consumers blocked in
XREADGROUP do: an entry goes to the longest-waiting worker with room; a
worker that frees room claims while it has some (`prefill_worker.py`,
`decode_worker.py`). Who claims a prompt first (`scheduler.claiming.claim_defer_s`,
`preempt.claim_defer`): a worker whose engine computes prompts waits before
claiming one more while a peer, as the heartbeats said, would be free sooner
(`Simulation.freest`, read once per beat), so the longest-waiting worker that
would not wait takes a new entry; when every waiting worker would, the one with
the shortest wait sleeps that long and claims then (unless a worker that waits
less took it first, or one of its prompts finished first: it wakes then), and
each entry wakes one such worker (`_claimer`).

Prefix caches and affinity (`prefix_cache=True`; requests with a chain, sessions.py): every
engine has an LRU prefix cache (prefix_cache.py), and the gateway decides as
`gateway/dispatch.py` does on the same view, with scheduler/prefix.py's
`CacheMatch` and `choose`: each worker's match (its cache, read when the
request arrives; live, the cache view trails the engine by a heartbeat), its
load as its last heartbeat said it and what this gateway placed for it and has
not seen end (`PlacedInFlight`); the route and admission count the tokens left
to compute where it goes. A placed request waits in its worker's affinity lane
(queues.py), which others may claim from once its bound passes (`may_claim`);
the fleet wakes waiting workers then. Fleet-level preemption looks only at the
shared streams' heads. A multi-turn session's next turn is sent a think time
after its answer ended (`SimRequest.next_turn`), as the bench's driver does.

Not modelled: Redis and network failures, cancellation by clients, the
worker's stream reclaim (XAUTOCLAIM), heartbeat loss. The fleet's own hops
(gateway, Redis, pub/sub: `FLEET_OVERHEAD_S`, from `skyline bench overhead`)
are added to every token time as one constant.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from skyline.core.config import SkylineConfig, prefill_cap
from skyline.scheduler.admission import (
    TtftCalibration, decide, demoted, handoff_wait_ms, learn_ttft, pool_rate, prefill_is_faster, stage_of,
)
from skyline.scheduler.claiming import NO_PEERS, RECHECK_S, ClaimRoom, FreestPeers, freest_peers
from skyline.scheduler.disagg import DisaggPolicy, route
from skyline.scheduler.elastic import HANDOFF_HOLD_MS, long_engines
from skyline.scheduler.preemption import PreemptionPolicy
from skyline.scheduler.prefix import CacheMatch, PlacedInFlight, StageLoads, choose
from skyline.scheduler.step_budget import background_tokens
from skyline.scheduler.tiers import Slo, resolve_slo
from skyline.tools.simulate.decode_worker import DecodeWorker
from skyline.tools.simulate.elastic_worker import BothStages, ElasticWorker
from skyline.tools.simulate.events import EventLoop
from skyline.tools.simulate.perf import PerfModel
from skyline.tools.simulate.preempt import left_tokens, measured_rate
from skyline.tools.simulate.prefill_worker import PrefillWorker
from skyline.tools.simulate.prefix_cache import HolderIndex, PrefixCache
from skyline.tools.simulate.queues import StageQueues
from skyline.tools.simulate.request import SimRequest

FLEET_OVERHEAD_S = 0.004  # `skyline bench overhead`: added TTFT p50 of gateway -> Redis -> workers -> pub/sub
PREEMPT_CHECK_S = RECHECK_S  # a full worker holding prompts re-checks the tier heads (as workers/runtime.py)
FLEET_REFRESH_S = 1.0  # workers heartbeat their measured rate every second; the gateway reads them
RATES_PER_REFRESH = 8  # meters read per refresh: bounds the cost of a 500-worker pool (documented staleness)


@dataclass(frozen=True)
class FleetSpec:
    mode: str  # "disagg", "colocated" or "elastic" (every worker takes either phase: elastic_worker.py)
    prefill: int  # prefill workers (0 when colocated or elastic)
    decode: int  # decode workers (elastic: the elastic workers, each on the decode model)

    def devices(self, perf_prefill: PerfModel, perf_decode: PerfModel) -> int:
        return self.prefill * perf_prefill.devices + self.decode * perf_decode.devices

    @property
    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D" if self.mode == "disagg" else f"{self.decode} {self.mode}"


class Simulation:
    def __init__(self, cfg: SkylineConfig, fleet: FleetSpec, perf_prefill: PerfModel, perf_decode: PerfModel,
                 record_itl: bool = False, allow_demotion: bool = False, overhead_s: float = FLEET_OVERHEAD_S,
                 neighbour_slowdown: float = 1.0, prefix_cache: bool = False):
        """`neighbour_slowdown` != 1: prefill worker i and decode worker i share one host's cores (as
        `skyline up` places them on a 2-core machine), and a step of either costs that factor more
        while the other engine is busy (measured by `skyline profile --handoff`). `prefix_cache`:
        engines cache the blocks of requests that carry a chain, and the gateway places those
        requests by them (`[gateway] prefix_affinity` and its options)."""
        if fleet.mode not in ("disagg", "colocated", "elastic"):
            raise ValueError(f"unknown fleet mode {fleet.mode!r}")
        if fleet.decode < 1 or (fleet.mode == "disagg" and fleet.prefill < 1):
            raise ValueError(f"a {fleet.mode} fleet needs workers: got {fleet.label}")
        self.elastic = fleet.mode == "elastic"
        if self.elastic and (prefix_cache or neighbour_slowdown != 1.0):
            raise ValueError("elastic fleets are simulated without prefix caches and shared hosts (not modelled yet)")
        self.cfg, self.fleet = cfg, fleet
        self.worker_cfg = cfg.worker
        self.defers = cfg.worker.claim_defer_max_s > 0  # busy workers wait before claiming a prompt
        self.claim_room = ClaimRoom(cfg.worker.max_running, cfg.worker.prefill_token_budget, cfg.worker.kv_watermark)
        self.perf_prefill, self.perf_decode = perf_prefill, perf_decode
        self.record_itl, self.allow_demotion, self.overhead_s = record_itl, allow_demotion, overhead_s
        self.kv_lease_s = cfg.engine.kv_lease_s
        # Each engine's per-request prompt-token cap per step (vLLM long_prefill_token_threshold),
        # resolved against the model's own step size as the live worker resolves it against its engine's.
        threshold = cfg.engine.long_prefill_token_threshold
        self.prefill_cap = prefill_cap(threshold, perf_prefill.max_step_tokens)
        self.decode_cap = prefill_cap(threshold, perf_decode.max_step_tokens)
        # ... and its short steps while only looser-tier prompts compute (scheduler/step_budget.py).
        self.prefill_background = background_tokens(cfg.engine.background_step_tokens, perf_prefill.max_step_tokens,
                                                   "prefill")
        self.decode_background = background_tokens(cfg.engine.background_step_tokens, perf_decode.max_step_tokens)
        self.urgent_priority = min(t.priority for t in cfg.tiers)
        self.max_held_steps = cfg.engine.hold_background_steps
        wc = cfg.worker
        self.preemption = PreemptionPolicy(wc.preemption, wc.max_preemptions, perf_prefill.max_step_tokens,
                                           self.prefill_cap, self.prefill_background, self.max_held_steps > 0)
        self.decode_preemption = replace(self.preemption, step_tokens=perf_decode.max_step_tokens,
                                         prefill_cap=self.decode_cap, background_tokens=self.decode_background)
        self.loop = EventLoop()
        self.tiers = cfg.tiers
        order = tuple(t.name for t in sorted(cfg.tiers, key=lambda t: t.ttft_ms))
        self.tier_rank = {name: i for i, name in enumerate(order)}
        self.prefill_q = StageQueues("prefill", order)
        self.decode_q = StageQueues("decode", order)
        self.admission = cfg.admission_policy() if cfg.gateway.admission else None
        self.calibration = TtftCalibration() if cfg.gateway.admission and cfg.gateway.ttft_calibration else None
        g = cfg.gateway
        # An elastic fleet routes as a disaggregated one (long prompts to the prefill stage, short ones
        # colocated); its workers are decode workers that also consume the prefill stage.
        self.disagg = DisaggPolicy("disagg" if self.elastic else fleet.mode, g.min_remote_prefill_tokens,
                                   g.max_prefill_backlog_tokens)
        self.prefill_workers = [PrefillWorker(self, i) for i in range(fleet.prefill if fleet.mode == "disagg" else 0)]
        self.decode_workers = [ElasticWorker(self, i) if self.elastic else DecodeWorker(self, i)
                               for i in range(fleet.decode)]
        self.has_prefill_stage = bool(self.prefill_workers) or self.elastic
        self.neighbour_slowdown = neighbour_slowdown
        if neighbour_slowdown != 1.0:
            for p, d in zip(self.prefill_workers, self.decode_workers):
                p.neighbour, d.neighbour = d, p
        self.prefill_ready: deque = deque(self.prefill_workers)
        self.decode_ready: deque = deque(self.decode_workers)
        if self.elastic:  # one blocked read over both stages' lanes: woken by work of either
            self.prefill_ready = self.decode_ready
        for w in self.prefill_workers + self.decode_workers:
            w.in_ready = True
        # What the gateway's FleetView cached at its last refresh.
        self.seen_rate: dict[str, float | None] = {"prefill": None, "decode": None}
        self.seen_prefill_backlog = 0
        self._refresh_next = {"prefill": 0, "decode": 0}
        # The heartbeats as the gateway's FleetView lists them (role, measured tokens/s), for pool_rate.
        decode_role = "elastic" if self.elastic else "decode"
        self._view = SimpleNamespace(workers=[SimpleNamespace(role="prefill", tokens_per_s=0.0)
                                              for _ in self.prefill_workers]
                                     + [SimpleNamespace(role=decode_role, tokens_per_s=0.0) for _ in self.decode_workers])
        self._preempt_armed = False
        self.ranks_seen: set[int] = set()  # tiers admitted so far (one alone: no preemption possible)
        self._slo_cache: dict[tuple[str, float, float], Slo] = {}
        self.counters = {"admitted": 0, "rejected": 0, "overloaded": 0, "demoted": 0, "preempted": 0,
                         "completed": 0, "handle_expired": 0}
        self.completed = 0
        self.sent_later: list[SimRequest] = []  # later turns of sessions, sent during the run
        self.end = 0.0
        # Prefix caches: one per engine, and what the gateway reads to place requests.
        self.caching = prefix_cache
        self.affinity = cfg.affinity_policy() if prefix_cache and cfg.gateway.prefix_affinity else None
        self.placed = PlacedInFlight()
        self.block_size = perf_decode.block_size
        self.workers = {w.name: w for w in self.prefill_workers + self.decode_workers}
        # The heartbeats as the gateway's fleet view holds them (scheduler.prefix.WorkerLoad).
        self._beats = {role: tuple(SimpleNamespace(worker_id=w.name, role=role, running=0, kv_usage=0.0,
                                                   max_running=cfg.worker.max_running,
                                                   kv_watermark=cfg.worker.kv_watermark if role == "decode" else 0.0)
                                   for w in pool)
                       for role, pool in (("prefill", self.prefill_workers), ("decode", self.decode_workers))}
        self._all_beats = self._beats["prefill"] + self._beats["decode"]
        # What every worker reads of its peers, as of their last heartbeat: an elastic worker to place a
        # decode (scheduler.elastic.PeerLoad), every worker for its claim defer (`freest`, of
        # scheduler.claiming.freest_peers); and where a full worker looks for a head to preempt for.
        self.peers = [SimpleNamespace(worker_id=w.name, role=role, running=0, max_running=cfg.worker.max_running,
                                      kv_usage=0.0, kv_watermark=cfg.worker.kv_watermark if role != "prefill" else 0.0,
                                      running_tokens=0, tokens_per_s=0.0, left_tokens=0, last_seen=0.0, computes_long=0,
                                      long_tokens=0, short_tokens=0)
                      for role, pool in (("prefill", self.prefill_workers), (decode_role, self.decode_workers))
                      for w in pool]
        self._decode_peers = self.peers[len(self.prefill_workers):]
        self._beat_by_name = {w.name: beat for w, beat in zip(self.decode_workers, self._decode_peers)}
        self.freest: FreestPeers = NO_PEERS
        self.long_set: frozenset[str] = frozenset()  # the phase mix's long engines (scheduler/elastic.py)
        self._preempt_pools: tuple = (((BothStages(self.prefill_q, self.decode_q), self.decode_workers),)
                                      if self.elastic else
                                      ((self.prefill_q, self.prefill_workers), (self.decode_q, self.decode_workers)))
        self._loads: dict[str, StageLoads] = {}  # the beats as placement reads them, rebuilt at each refresh
        self.cache_view = HolderIndex()  # which engines hold each block (the live cache view)
        if prefix_cache:
            for w in self.prefill_workers + self.decode_workers:
                perf = perf_prefill if w in self.prefill_workers else perf_decode
                w.cache = PrefixCache(perf.kv_capacity_tokens // perf.block_size, perf.block_size, w.name,
                                      self.cache_view)

    # -- the gateway ------------------------------------------------------------------------------

    def _slo(self, req: SimRequest) -> Slo:
        """resolve_slo is pure and depends on arrival only through the deadline: memoised per class of request."""
        key = (req.requested_tier, req.ttft_target_ms, req.tpot_target_ms)
        slo = self._slo_cache.get(key)
        if slo is None:
            ttft = max(1, round(req.ttft_target_ms)) if req.ttft_target_ms < float("inf") else None
            tpot = max(1, round(req.tpot_target_ms)) if req.tpot_target_ms < float("inf") else None
            slo = self._slo_cache[key] = resolve_slo(self.tiers, self.cfg.default_tier, 0, tier=req.requested_tier,
                                                     ttft_ms=ttft, tpot_ms=tpot)
        return slo

    def arrive(self, req: SimRequest) -> None:
        now = self.loop.now
        slo: Slo = self._slo_cache.get((req.requested_tier, req.ttft_target_ms, req.tpot_target_ms)) or self._slo(req)
        req.tier, req.priority, req.tpot_ms = slo.tier, slo.priority, slo.tpot_ms
        req.deadline = now + slo.ttft_ms / 1000
        n = req.prompt_tokens
        match = self._match(req) if req.chain is not None and self.affinity is not None else None  # off: blind
        left = match.best_uncached("decode") if match is not None else n  # the route counts what is left
        faster = None
        if self.admission is not None and self.has_prefill_stage:  # as the live gateway: with the backlog read
            def faster() -> bool:
                return prefill_is_faster(self.admission, self.tiers, slo.tier,  # type: ignore[arg-type]
                                         match.best_uncached("prefill") if match is not None else n, left,
                                         {"prefill": self.prefill_q.backlog, "decode": self.decode_q.backlog},
                                         self.seen_rate, self.calibration)
        req.route = path = route(self.disagg, left, self.seen_prefill_backlog, faster)
        stage = stage_of(path)
        if stage == "prefill":
            q, ready = self.prefill_q, self.prefill_ready
        else:
            q, ready = self.decode_q, self.decode_ready
        if match is not None:  # dispatch.py `_placed`: the worker to wait for, and what it has left to compute
            placed = choose(self.affinity, match, stage, f"r{req.index}", int(now * 1000), int(req.deadline * 1000),
                            self.placed, self.seen_rate[stage]) if self.affinity is not None else None
            if placed is not None:
                req.placed_for, req.until_ms = placed.worker, placed.until_ms
            holders = self._beats[stage]
            worker = placed.worker if placed else holders[0].worker_id if len(holders) == 1 else None
            req.backlog_tokens = n = match.uncached_tokens(worker)
        if self.admission is not None:
            handoff = handoff_wait_ms(self.admission, self.tiers, slo.tier, self.decode_q.backlog,
                                      self.seen_rate["decode"]) if stage == "prefill" else 0.0
            d, req.model_ttft_ms = decide(self.admission, self.tiers, slo.tier, slo.ttft_ms, n, stage,
                                          q.backlog, self.seen_rate[stage], self.calibration, self.allow_demotion,
                                          handoff)
            if d.action in ("reject", "overloaded"):
                if req.placed_for is not None:
                    self.placed.done(f"r{req.index}")  # refused: it loads nobody
                self.counters["rejected" if d.action == "reject" else "overloaded"] += 1
                req.outcome = "rejected" if d.action == "reject" else "error"
                req.decision = d.reason
                return
            if d.action == "demote":
                slo = demoted(slo, self.cfg.tier(d.tier))
                req.tier, req.priority = slo.tier, slo.priority
                req.deadline = now + slo.ttft_ms / 1000
                req.decision = "demote"
                self.counters["demoted"] += 1
        self.counters["admitted"] += 1
        tier = req.tier
        req.rank = rank = self.tier_rank[tier]
        self.ranks_seen.add(rank)
        q.backlog[tier] += n  # q.reserve and q.push, inlined (once per request)
        if req.placed_for is not None:
            self._push_placed(q, ready, req, None, req.placed_for)
        else:
            q.queues[tier].append((req, None))
            q.size += 1
        # New entries go to the workers blocked longest (Redis serves blocked XREADGROUPs in order); each
        # claims if it has room and re-queues itself at the tail while it has room (a shielded worker that
        # finds nothing it may take leaves the queue).
        self._wake_for(q, ready)
        if q.size and self.preemption.enabled:
            self._arm_preemption()

    def _match(self, req: SimRequest) -> CacheMatch:
        """What each worker's engine holds of the request's prompt, and the workers' heartbeats: the
        live gateway's `CacheMatch` (there read from the cache view in Redis)."""
        chain = req.chain[:req.prompt_blocks]  # type: ignore[index]
        return CacheMatch(req.prompt_tokens, self.block_size, self.cache_view.matched(chain),
                          self._all_beats, self._loads)

    def _push_placed(self, q, ready, req: SimRequest, prefill_end, worker: str) -> None:
        """Into the affinity lane of the worker the request was placed for: that worker claims it if it is
        waiting for work; any other once the bound (`req.until_ms`) passes (the fleet wakes the waiting ones then)."""
        q.push_placed(req, (req, prefill_end), worker)
        w = self.workers[worker]
        if w.in_ready:
            ready.remove(w)
            w.in_ready = False
            w.claim_while_room(1)
        self.loop.at(req.until_ms / 1000, self._bound_passed, (q, ready))

    def _bound_passed(self, arg) -> None:
        """A placed request's bound passed: the workers waiting for work may claim it now (live: their
        blocked read of the lanes they may take from times out at the first bound)."""
        q, ready = arg
        now_ms = int(self.loop.now * 1000)
        for _ in range(len(ready)):
            if not ready or not q.placed_size or not q.claimable(ready[0].name, now_ms):
                return
            if not self._wake_one(ready, 1):
                return

    def _wake_for(self, q: StageQueues, ready: deque) -> None:
        """Wake waiting workers, longest-waiting first, while `q` has entries for anyone. A worker that claims
        nothing of it (an elastic worker leaving the heads to its peers, `leave_for`, or claiming from its
        other stage) stays waiting at the tail: after every waiting worker has in a row, the rest wait."""
        idle = 0
        while q.size > q.placed_size and ready and idle < len(ready):
            size = q.size
            if not self._wake_one(ready):
                return
            idle = idle + 1 if q.size == size else 0

    def _wake_one(self, ready: deque, placed: int = 0) -> bool:
        """Wake the waiting worker that claims the next entry (`_claimer`); False when none is woken."""
        w = ready[0]
        if self.defers:
            w = self._claimer(ready, placed)
            if w is None:
                return False
            if w is not ready[0]:
                ready.remove(w)
                w.in_ready = False
                w.claim_while_room(1)
                return True
        ready.popleft()
        w.in_ready = False
        w.claim_while_room(1)
        return True

    def _claimer(self, ready: deque, placed: int = 0) -> Any:
        """Which waiting worker answers the next entry first (live: every blocked worker wakes; those whose
        engine computes nothing answer at once, the others after their claim defer, `claim_wait`): the
        longest-waiting one that would not wait; else the one that waits least, which then sleeps before
        its claim, unless each entry it could claim (`placed`: entries past their bound, besides the shared
        streams') already has a worker sleeping towards it (None). Only when the longest-waiting worker
        would wait are the others asked, each about that entry."""
        first = ready[0]
        wait = first.claim_wait()
        if wait is None:
            return first
        q, item, best_s = wait
        if len(self.ranks_seen) < 2:
            # One tier so far: a worker computing nothing claims at once (the hot path: an attribute per
            # worker; the waits of the others are computed only when none is idle).
            for w in ready:
                if not w.computing_tokens:
                    return w
            if q.size - q.placed_size + placed <= q.deferring:
                return None
        best = first
        for w in ready:
            if w is first:
                continue
            s = w.wait_for(q, item)
            if s <= 0:
                return w
            if s < best_s:
                best, best_s = w, s
        return best if q.size - q.placed_size + placed > q.deferring else None

    def to_decode(self, req: SimRequest, kv_from_prefill: bool) -> None:
        """A prefill worker hands the request (and its KV handle) to the decode stage."""
        q, ready = self.decode_q, self.decode_ready
        q.queues[req.tier].append((req, self.loop.now if kv_from_prefill else None))  # q.push, inlined
        q.size += 1
        self._wake_for(q, ready)  # to the workers blocked longest

    def hand_off(self, req: SimRequest, peer: str, by: str) -> None:
        """An elastic worker computed the prompt and hands its decode to `peer`: on the peer's affinity lane
        of the decode stage, any worker's after `HANDOFF_HOLD_MS` (workers/prefill.py)."""
        req.prefilled_by = by
        req.until_ms = int(self.loop.now * 1000) + HANDOFF_HOLD_MS
        self._push_placed(self.decode_q, self.decode_ready, req, self.loop.now, peer)

    def on_done(self, req: SimRequest) -> None:
        req.finish(self.overhead_s)
        self.completed += 1
        if self.calibration is not None:  # the gateway's `learn` hook
            learn_ttft(self.calibration, req.route, req.tier, req.model_ttft_ms, req.ttft_s * 1000)
        if req.placed_for is not None:
            self.placed.done(f"r{req.index}")
        nxt = req.next_turn
        if nxt is not None:  # the session's next turn: a think time after the client got the answer
            nxt.send_at = req.done_t + self.overhead_s + nxt.think_s
            self.loop.at(nxt.send_at, self._send_turn, nxt)

    def _send_turn(self, req: SimRequest) -> None:
        if self.loop.now <= self.end:  # (after the drain deadline the bench sends nothing more)
            self.sent_later.append(req)
            self.arrive(req)

    # -- periodic fleet activity ----------------------------------------------------------------------

    def _refresh(self, _arg=None) -> None:
        """Heartbeats + the gateway's FleetView: measured prefill rates and the cached prefill backlog.

        Every worker heartbeats the prefill rate its meter measured: prefill
        workers over every prompt, decode workers over the prompts they
        computed themselves (colocated routes), as `workers/runtime.py` does.
        """
        now_ms = int(self.loop.now * 1000)
        for role, pool in (("prefill", self.prefill_workers), ("decode", self.decode_workers)):
            if not pool:
                continue
            n, start = min(len(pool), RATES_PER_REFRESH), self._refresh_next[role]
            for i in range(n):
                w = pool[(start + i) % len(pool)]
                w.rate_cache = (self.loop.now, w.meter.tokens_per_s(now_ms) or 0.0)
            self._refresh_next[role] = (start + n) % len(pool)
        view = self._view
        everyone: list[Any] = [*self.prefill_workers, *self.decode_workers]
        for wk, info in zip(everyone, view.workers):
            info.tokens_per_s = wk.rate_cache[1]
        if self.caching:  # the load placement reads: running requests and KV usage, as heartbeated
            for w, beat in zip(self.prefill_workers, self._beats["prefill"]):
                beat.running = len(w.held)
            for w, beat in zip(self.decode_workers, self._beats["decode"]):
                beat.running = w.B + w.arriving + len(w.local) + len(w.joining)
                beat.kv_usage = (w.C + w.reserved) / w.kv_capacity
            self._loads = {role: StageLoads(beats, role) for role, beats in self._beats.items()}
        for w, peer in zip(self.prefill_workers, self.peers):  # each heartbeat as the live `_beat` fills it
            peer.running, peer.running_tokens, peer.tokens_per_s = len(w.held), w.tokens_held, w.rate_cache[1]
            peer.left_tokens = left_tokens(w, w.held, measured_rate(w)) if w.held else 0
            peer.last_seen = self.loop.now
        for w, peer in zip(self.decode_workers, self._decode_peers):
            self._beat_of(w, peer)
        if self.defers:  # what each worker's claim defer reads until the next beat (live: `see_peers`)
            wc = self.worker_cfg
            self.freest = freest_peers(self.peers, wc.prefill_token_budget, wc.prior_prefill_tokens_per_s)
        if self.elastic and self.worker_cfg.phase_mix:  # live: `WorkerRuntime.see_peers`
            self.long_set = long_engines(self.peers, self.long_set)
        self.seen_rate = {"prefill": pool_rate(view.workers, "prefill"), "decode": pool_rate(view.workers, "decode")}
        self.seen_prefill_backlog = sum(self.prefill_q.backlog.values())
        self.loop.after(FLEET_REFRESH_S, self._refresh)

    def _beat_of(self, w: Any, peer: SimpleNamespace) -> SimpleNamespace:
        """Fill `peer` with decode worker `w`'s heartbeat as of now (live: `WorkerRuntime._fill_info`)."""
        peer.running = w.B + w.arriving + len(w.local) + len(w.joining)
        peer.kv_usage = (w.C + w.reserved) / w.kv_capacity
        peer.running_tokens = w.local_tokens
        peer.tokens_per_s = w.rate_cache[1]
        peer.left_tokens = left_tokens(w, w.local, measured_rate(w)) if w.local else 0
        peer.computes_long = int(isinstance(w, ElasticWorker) and w.computes_long())
        if isinstance(w, ElasticWorker):
            peer.long_tokens, peer.short_tokens = w.mix.totals(self.loop.now)
        peer.last_seen = self.loop.now
        return peer

    def beat_now(self, worker_id: str) -> SimpleNamespace:
        """A decode worker's newest heartbeat, between beats (live: a worker announces a prompt it starts,
        and an elastic worker reads its chosen peer's beat before handing it a prompt)."""
        return self._beat_of(self.workers[worker_id], SimpleNamespace(**vars(self._beat_by_name[worker_id])))

    def _arm_preemption(self) -> None:
        if not self._preempt_armed:
            self._preempt_armed = True
            self.loop.at(self.loop.now, self._preempt_tick)

    def _preempt_tick(self, _arg=None) -> None:
        """Every full worker holding prompts checks its stage's EDF head (live: at 20 Hz while full)."""
        self._preempt_armed = False
        for q, pool in self._preempt_pools:
            entry = q.head()
            if entry is None:
                continue
            head_rank = entry[0].rank
            for w in pool:
                held = w.held if pool is self.prefill_workers else w.local  # type: ignore[union-attr]
                if held and not w.has_room() and any(h.req.rank > head_rank for h in held):
                    head = q.head()  # an earlier worker's preemption may have changed it
                    if head is not None and w.preempt(head[0], claimed=False):
                        w.claim_while_room()
        if self.prefill_q.size or self.decode_q.size:
            self._preempt_armed = True
            self.loop.after(PREEMPT_CHECK_S, self._preempt_tick)

    # -- running ------------------------------------------------------------------------------------

    def run(self, requests: list[SimRequest], drain_s: float) -> float:
        """Serve `requests` (sorted by send time); returns the bench's duration (first send to last
        completion, or to the drain deadline when stragglers were cut). Later turns of sessions that
        were sent during the run are appended to `requests`."""
        if not requests:
            return 0.0
        self._refresh()
        end = self.end = requests[-1].send_at + drain_s
        self.loop.run(end, ((r.send_at, r) for r in requests), self.arrive)
        requests.extend(self.sent_later)
        finished = [r.done_t for r in requests if r.outcome == "ok"]
        cut = any(r.outcome == "cancelled" for r in requests)
        return end if cut or not finished else max(finished) + self.overhead_s

    def describe(self) -> dict:
        return {"fleet": self.fleet.label, "mode": self.fleet.mode, "prefill_workers": len(self.prefill_workers),
                "decode_workers": len(self.decode_workers),
                "devices": self.fleet.devices(self.perf_prefill, self.perf_decode), "counters": dict(self.counters),
                **({"prefix_cache": {"affinity": self.affinity is not None, "block_size": self.block_size,
                                     "evicted_blocks": sum(w.cache.evicted  # type: ignore[misc, union-attr]
                                                           for w in self.workers.values())}}
                   if self.caching else {})}


def with_overrides(cfg: SkylineConfig, admission: bool | None = None, preemption: bool | None = None,
                   max_running: int | None = None, min_remote_prefill_tokens: int | None = None,
                   tpot_headroom: float | None = None, long_prefill_token_threshold: int | None = None,
                   background_step_tokens: int | None = None, hold_background_steps: int | None = None) -> SkylineConfig:
    """The config the simulated fleet runs with, after command-line overrides."""
    if long_prefill_token_threshold is not None:
        cfg = replace(cfg, engine=replace(cfg.engine, long_prefill_token_threshold=long_prefill_token_threshold))
    if background_step_tokens is not None:
        cfg = replace(cfg, engine=replace(cfg.engine, background_step_tokens=background_step_tokens))
    if hold_background_steps is not None:
        cfg = replace(cfg, engine=replace(cfg.engine, hold_background_steps=hold_background_steps))
    if admission is not None:
        cfg = replace(cfg, gateway=replace(cfg.gateway, admission=admission))
    if min_remote_prefill_tokens is not None:
        cfg = replace(cfg, gateway=replace(cfg.gateway, min_remote_prefill_tokens=min_remote_prefill_tokens))
    worker = cfg.worker
    if preemption is not None:
        worker = replace(worker, preemption=preemption)
    if max_running is not None:
        worker = replace(worker, max_running=max_running)
    if tpot_headroom is not None:
        worker = replace(worker, tpot_headroom=tpot_headroom)
    return replace(cfg, worker=worker)
