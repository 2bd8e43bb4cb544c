"""A simulated prefill worker: the live worker's claim rules around a stepped engine model.

Claiming (`scheduler.claiming`, as the live worker): while it holds fewer than `max_running`
prompts and fewer than `prefill_token_budget` prompt tokens, it claims the
EDF head of the prefill stage. The engine (as vLLM with priority
scheduling and chunked prefill) runs steps of at most `max_step_tokens`
tokens: prompts it has started keep their share of the step first, then
waiting prompts by priority, then claim order, each at most the engine's
per-request cap (`long_prefill_token_threshold`) while it holds more than one, and with Skyline's
step shape by tier (`scheduler.step_budget.StepShaper`, the live scheduler hook's: shorter steps while
it holds only looser-tier prompts, those held back while strictest-tier ones compute). A finished prompt is timed
into the worker's `ThroughputMeter` (the live meter class), acked (its
tokens leave the backlog) and handed to the decode stage.

Fleet-level preemption (`preempt.py`), as the live worker: for each request
it claims, and for the EDF head while it is full.
While it computes prompts it waits before claiming one more when a peer
would be free sooner (`scheduler.claiming.claim_defer_s`, `preempt.claim_defer`),
so an idle worker takes a new prompt first; it stops waiting when one of its
prompts is done or preempted (live: `HeldTable.freed` wakes the claim loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skyline.scheduler.claiming import ClaimShield
from skyline.scheduler.step_budget import StepShaper
from skyline.scheduler.throughput import ThroughputMeter
from skyline.tools.simulate.preempt import claim_defer, claim_for, peek_for, victims_for
from skyline.tools.simulate.request import SimRequest

if TYPE_CHECKING:
    from skyline.tools.simulate.decode_worker import DecodeWorker
    from skyline.tools.simulate.fleet import Simulation
    from skyline.tools.simulate.prefix_cache import PrefixCache
    from skyline.tools.simulate.queues import StageQueues


class _Held:
    __slots__ = ("aborted", "claimed_at", "done", "order", "req")

    def __init__(self, req: SimRequest, order: int, now: float):
        # a prefix-cache hit: the engine computes only the rest
        self.req, self.done, self.order, self.aborted, self.claimed_at = req, req.cached_tokens, order, False, now


class PrefillWorker:
    def __init__(self, sim: Simulation, wid: int):
        self.sim, self.wid = sim, wid
        self.name = f"prefill-{wid}"
        self.held: list[_Held] = []
        self.tokens_held = 0
        self.stepping = False
        self.meter = ThroughputMeter()
        self.rate_cache = (-1.0, 0.0)  # (refreshed at, tokens/s): the live worker reads its meter per heartbeat
        self._order = 0
        self.busy_s = 0.0
        self.in_ready = False  # waiting for work in the stage's ready queue (a blocked XREADGROUP)
        # The decode worker sharing this host's cores (Simulation.shared_host).
        self.neighbour: DecodeWorker | None = None
        self.room = sim.claim_room
        self.preemption = sim.preemption  # the policy with this engine's step shape
        self.claims = ClaimShield()  # after a preemption: claim only the protected tiers for a while
        self.shaper = StepShaper(urgent_priority=sim.urgent_priority, step_tokens=sim.perf_prefill.max_step_tokens,
                                 prefill_cap=sim.prefill_cap, background=sim.prefill_background,
                                 max_held=sim.max_held_steps)
        self.cache: PrefixCache | None = None  # its engine's prefix cache, when the fleet models one
        # Waiting out a claim defer (`claim_wait`; live: its claim loop sleeps), on which stage's queues,
        # and which sleep (a wake-up of an earlier one, cut short, finds another number).
        self.asleep = False
        self.sleep_q: StageQueues | None = None
        self.sleeps = 0
        self.defers = sim.worker_cfg.claim_defer_max_s > 0

    # -- claiming ------------------------------------------------------------------

    def has_room(self) -> bool:
        return self.room.prefill(len(self.held), self.tokens_held)

    def claim_while_room(self, limit: int = 1 << 30, woke: bool = False) -> None:
        """Claim up to `limit` entries while there is room (the live loop claims one at a time until full).
        A claim its engine's prompts defer (`claim_wait`) waits: the worker sleeps, out of the ready queue,
        and claims when it wakes (`woke`: this call is that claim, not deferred again)."""
        if self.asleep:
            return  # its claim loop sleeps: it claims when it wakes
        sim = self.sim
        q = sim.prefill_q
        shielded = slept = False
        room = None  # has_room() as last asked, while nothing changed since (None: ask again)
        while q.size and limit > 0:
            room = self.has_room()
            if not room:
                break
            if self.tokens_held and not woke:
                wait = self.claim_wait(q)
                if wait is not None:
                    self._sleep(q, wait[2])
                    slept = True
                    break
            woke = False
            item = claim_for(self, q, self.held)
            if item is None:  # shielded and only looser tiers wait, or only work placed for others
                # Shielded: out of the ready queue, nothing there is its to take; its steps claim again.
                shielded = self.claims.shield is not None
                break
            limit -= 1
            req: SimRequest = item[0]
            if self.cache is not None and req.chain is not None:
                req.cached_tokens = self.cache.hit(req)  # the engine computes only the rest
            self.preempt(req)  # live: every claimed prompt competes for the step budget
            self._order += 1
            now = sim.loop.now
            self.held.append(_Held(req, self._order, now))
            self.tokens_held += req.prompt_tokens
            if not req.prefill_start:
                req.prefill_start = now
            room = None
        if not self.stepping and self.held:
            self._start_step()
            if self.neighbour is not None:
                self.neighbour.neighbour_changed()  # from idle to busy
        if not shielded and not slept and not self.in_ready and (self.has_room() if room is None else room):
            self.in_ready = True  # into the ready queue
            sim.prefill_ready.append(self)

    def claim_wait(self, q: StageQueues | None = None) -> tuple | None:
        """(stage queue, entry, seconds) when the worker's next claim waits before it is made
        (`preempt.claim_defer`: its engine computes prompts); None when it claims at once."""
        if not self.tokens_held or not self.defers:
            return None
        if q is None:
            q = self.sim.prefill_q
        item = peek_for(self, q, self.held)
        if item is None:
            return None
        wait = claim_defer(self, q, item, self.held)
        return (q, item, wait) if wait > 0 else None

    @property
    def computing_tokens(self) -> int:
        """Prompt tokens its engine computes: what the claim defer weighs."""
        return self.tokens_held

    def wait_for(self, q: StageQueues, item: tuple) -> float:
        """Seconds the worker would wait before claiming entry `item` of `q` (0: it claims it now)."""
        return claim_defer(self, q, item, self.held) if self.held else 0.0

    def leave_for(self, q: StageQueues) -> None:
        """A prefill worker leaves no head to its peers (the elastic worker's rule)."""
        return None

    def idle_claim_defer(self, q: StageQueues) -> float:
        """The claim defer of a worker whose engine computes no prompt: none."""
        return 0.0

    def _sleep(self, q: StageQueues, wait: float) -> None:
        """Wait `wait` s before the next claim (live: `TierQueues.claim` sleeps), out of the ready queue."""
        self.asleep = True
        self.sleep_q = q
        self.sleeps += 1
        q.deferring += 1
        if self.in_ready:
            self.in_ready = False
            self.sim.prefill_ready.remove(self)
        self.sim.loop.after(wait, self._wake, self.sleeps)

    def _wake(self, sleep: int) -> None:
        """The defer is over: claim what is due now (live: the heads are peeked again), not deferred again.
        A wake-up of a sleep already cut short (`_freed`) does nothing."""
        if not self.asleep or sleep != self.sleeps:
            return
        self.asleep = False
        self.sleep_q.deferring -= 1  # type: ignore[union-attr]
        self.sleep_q = None
        self.claim_while_room(woke=True)

    def _freed(self) -> None:
        """A prompt of its engine is done or preempted: a worker waiting out a defer claims now (live:
        `HeldTable.freed` wakes its claim loop)."""
        if self.asleep:
            self._wake(self.sleeps)

    def busy(self) -> bool:
        return self.stepping

    # -- engine steps ------------------------------------------------------------------

    def _start_step(self) -> None:
        if len(self.held) == 1:
            order = self.held  # the common case in a fleet with spare prefill capacity
        else:
            order = [h for h in self.held if h.done > h.req.cached_tokens]  # started first, as vLLM runs them
            order += sorted((h for h in self.held if h.done == h.req.cached_tokens), key=lambda h: (h.req.priority, h.order))
        sim = self.sim
        if len(sim.ranks_seen) < 2:  # shape_step's hot path, inlined
            shape = self.shaper.one_priority(order[0].req.priority, len(order), 0, sim.loop.now)
        else:
            order, shape = shape_step(self.shaper, order, 0, sim)
        if len(order) == 1:  # plan_chunks of one prompt (no cap: it is alone), inlined
            h = order[0]
            n, budget = h.req.prompt_tokens - h.done, shape.tokens
            if budget < n:
                n = budget
            chunks, work = ([(h.done, n)], [(h, n)]) if budget > 0 else ([], [])
        else:
            chunks, work = plan_chunks(order, shape.tokens, shape.prefill_cap)
        dur = sim.perf_prefill.prefill_step_s(chunks)
        if self.neighbour is not None and self.neighbour.busy():
            dur *= sim.neighbour_slowdown
        self.stepping = True
        self.busy_s += dur
        sim.loop.after(dur, self._step_done, work)

    def _step_done(self, work: list[tuple[_Held, int]]) -> None:
        self.stepping = False
        now = self.sim.loop.now
        finished = False
        for h, n in work:
            if h.aborted:
                continue  # preempted during the step: its work is lost
            h.done += n
            if h.done >= h.req.prompt_tokens:
                self._finish(h, now)
                finished = True
        if finished and self.asleep:
            self._freed()
        elif self.held or self.sim.prefill_q.size or not self.in_ready:  # (else claim_while_room has nothing to do)
            self.claim_while_room()
        if not self.stepping and self.held:
            self._start_step()
        if not self.stepping and self.neighbour is not None:
            self.neighbour.neighbour_changed()  # from busy to idle

    def _finish(self, h: _Held, now: float) -> None:
        req = h.req
        self.held.remove(h)
        self.tokens_held -= req.prompt_tokens
        req.prefill_end = now
        self.meter.record(int(h.claimed_at * 1000), int(now * 1000), req.prompt_tokens)
        sim = self.sim
        sim.prefill_q.backlog[req.tier] -= req.backlog_tokens  # ack: off the backlog (q.release, inlined)
        if self.cache is not None and req.chain is not None:
            self.cache.store(req.chain, req.prompt_blocks)
        sim.to_decode(req, kv_from_prefill=True)

    # -- fleet-level preemption ---------------------------------------------------------------

    def preempt(self, head: SimRequest, claimed: bool = True) -> int:
        """Abort the prompts that keep request `head` from its deadline (requeued); how many.
        `claimed`: this worker just took `head` (False: still queued, the worker full)."""
        victims = victims_for(self, self.held, head, claimed)
        for h in victims:
            h.aborted = True
            self.held.remove(h)
            self.tokens_held -= h.req.prompt_tokens
            # Re-queued on its retry lane with its original deadline; enqueue adds its tokens to the
            # backlog and the ack of the old entry removes them: no net change.
            self.sim.prefill_q.push_retry(h.req, (h.req, None))
        if victims and self.asleep:
            self._freed()
        return len(victims)


def shape_step(shaper: StepShaper, order: list, decoding: int, sim: Simulation) -> tuple[list, Any]:
    """The engine's step shape by tier (the live scheduler hook's `StepShaper`) for the prompts in `order`
    (handles with `.req` and `.done`, in the engine's order) and `decoding` running decodes: the prompts
    that take part in the step (started looser-tier ones sit out while it holds them back) and its shape."""
    if len(sim.ranks_seen) < 2:
        # One tier so far in the whole workload: every prompt has its priority (the hot path of big fleets).
        return order, shaper.one_priority(order[0].req.priority if order else 0, len(order), decoding, sim.loop.now)
    prompts = [(h.req.priority, h.req.prompt_tokens - h.done, True) if h.done > h.req.cached_tokens
               else (h.req.priority, h.req.prompt_tokens, False) for h in order]
    shape = shaper.shape(prompts, decoding, sim.loop.now)
    if shape.hold_background:
        urgent = shaper.urgent_priority
        order = [h for h in order if h.req.priority <= urgent]
    return order, shape


def plan_chunks(handles, budget: int, cap: int = 0) -> tuple[list[tuple[int, int]], list]:
    """One chunked-prefill step: prompt tokens taken from `handles` in order until
    the step's token `budget` is spent, at most `cap` per prompt (0 = no cap; the
    caller passes 0 when the engine holds one request alone, as vLLM lifts its
    long_prefill_token_threshold then). Returns ((tokens done before, tokens now)
    per prompt, for the performance model) and ((handle, tokens now) per prompt)."""
    chunks, work = [], []
    for h in handles:
        if budget <= 0:
            break
        n = min(budget, h.req.prompt_tokens - h.done)
        if 0 < cap < n:
            n = cap
        chunks.append((h.done, n))
        work.append((h, n))
        budget -= n
    return chunks, work
