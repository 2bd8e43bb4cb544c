"""A simulated prefill worker: the claim rule of `workers/runtime.py` around a stepped engine model.

Claiming (as the live worker): while it holds fewer than `max_running`
prompts and fewer than `prefill_token_budget` prompt tokens, it claims the
EDF head of the prefill stage. The engine (as vLLM with priority
scheduling and chunked prefill) runs steps of at most `max_step_tokens`
tokens: prompts it has started keep their share of the step first, then
waiting prompts by priority, then claim order, each at most the engine's
per-request cap (`long_prefill_token_threshold`) while it holds more than one, and with Skyline's
step shape by tier (`scheduler.step_budget`: shorter steps while it holds only looser-tier prompts,
those held back while strictest-tier ones compute). A finished prompt is timed
into the worker's `ThroughputMeter` (the live meter class), acked (its
tokens leave the backlog) and handed to the decode stage.

Fleet-level preemption (`preempt.py`), as the live worker: for each request
it claims, and for the EDF head while it is full.
"""

from __future__ import annotations

from skyline.scheduler.preemption import Shield
from skyline.scheduler.step_budget import expecting_urgent, next_step
from skyline.scheduler.throughput import ThroughputMeter
from skyline.simulate.preempt import claim_for, victims_for


class _Held:
    __slots__ = ("aborted", "claimed_at", "done", "order", "req")

    def __init__(self, req, order: int, now: float):
        # a prefix-cache hit: the engine computes only the rest
        self.req, self.done, self.order, self.aborted, self.claimed_at = req, req.cached_tokens, order, False, now


class PrefillWorker:
    def __init__(self, sim, wid: int):
        self.sim, self.wid = sim, wid
        self.name = f"prefill-{wid}"
        self.held: list[_Held] = []
        self.tokens_held = 0
        self.stepping = False
        self.meter = ThroughputMeter()
        self.rate_cache = (-1.0, 0.0)  # (refreshed at, tokens/s): the live worker reads its meter per heartbeat
        self._order = 0
        self.held_steps = 0  # engine steps in a row that held looser-tier prompts back
        self.last_urgent: float | None = None  # when a strictest-tier prompt was last in the engine
        self.busy_s = 0.0
        self.in_ready = False  # waiting for work in the stage's ready queue (a blocked XREADGROUP)
        self.neighbour = None  # the decode worker sharing this host's cores (Simulation.shared_host)
        self.max_running, self.token_budget = sim.worker_cfg.max_running, sim.worker_cfg.prefill_token_budget
        self.preemption = sim.preemption  # the policy with this engine's step shape
        self.shield = None  # after a preemption: claim only the protected tiers for a while

    # -- claiming ------------------------------------------------------------------

    def has_room(self) -> bool:
        return len(self.held) < self.max_running and self.tokens_held < self.token_budget

    def claim_while_room(self, limit: int = 1 << 30) -> None:
        """Claim up to `limit` entries while there is room (the live loop claims one at a time until full)."""
        q = self.sim.prefill_q
        shielded = False
        while q.size and limit > 0 and self.has_room():
            item = claim_for(self, q, self.held)
            if item is None:  # shielded: only looser tiers wait
                shielded = True  # out of the ready queue: nothing there is its to take; its steps claim again
                break
            limit -= 1
            req, _ = item
            self.preempt(req)  # live: every claimed prompt competes for the step budget
            self._order += 1
            self.held.append(_Held(req, self._order, self.sim.loop.now))
            self.tokens_held += req.prompt_tokens
            if not req.prefill_start:
                req.prefill_start = self.sim.loop.now
        if not self.stepping and self.held:
            self._start_step()
            if self.neighbour is not None:
                self.neighbour.neighbour_changed()  # from idle to busy
        if not shielded:
            self.sim.note_room(self, self.sim.prefill_ready)

    def busy(self) -> bool:
        return self.stepping

    # -- engine steps ------------------------------------------------------------------

    def _start_step(self) -> None:
        budget = self.sim.perf_prefill.max_step_tokens
        if len(self.held) == 1:
            order = self.held  # the common case in a fleet with spare prefill capacity
        else:
            order = [h for h in self.held if h.done > h.req.cached_tokens]  # started first, as vLLM runs them
            order += sorted((h for h in self.held if h.done == h.req.cached_tokens), key=lambda h: (h.req.priority, h.order))
        cap = self.sim.prefill_cap
        if len(self.sim.ranks_seen) > 1:
            if self.sim.prefill_background or self.sim.max_held_steps:
                order, budget, cap, self.held_steps = shape_step(self, order, 0, budget, cap,
                                                                 self.sim.prefill_background, self.held_steps)
        elif order[0].req.priority <= self.sim.urgent_priority:
            # One tier so far, the strictest: nothing to shape (the hot path of big fleets); remember it.
            self.last_urgent = self.sim.loop.now
        chunks, work = plan_chunks(order, budget, cap if len(order) > 1 else 0)
        dur = self.sim.perf_prefill.prefill_step_s(chunks)
        if self.neighbour is not None and self.neighbour.busy():
            dur *= self.sim.neighbour_slowdown
        self.stepping = True
        self.busy_s += dur
        self.sim.loop.after(dur, self._step_done, work)

    def _step_done(self, work) -> None:
        self.stepping = False
        now = self.sim.loop.now
        for h, n in work:
            if h.aborted:
                continue  # preempted during the step: its work is lost
            h.done += n
            if h.done >= h.req.prompt_tokens:
                self._finish(h, now)
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
        self.sim.prefill_q.release(req.tier, req.prompt_tokens)  # ack: off the backlog
        self.sim.to_decode(req, kv_from_prefill=True)

    # -- fleet-level preemption ---------------------------------------------------------------

    def preempt(self, head, claimed: bool = True) -> int:
        """Abort the prompts that keep request `head` from its deadline (requeued); how many.
        `claimed`: this worker just took `head` (False: still queued, the worker full)."""
        victims = victims_for(self, self.held, head, claimed)
        if victims:
            self.shield = Shield(head.rank, int(head.deadline * 1000)).merged(self.shield)
        for h in victims:
            h.aborted = True
            self.held.remove(h)
            self.tokens_held -= h.req.prompt_tokens
            # Re-queued on its retry lane with its original deadline; enqueue adds its tokens to the
            # backlog and the ack of the old entry removes them: no net change.
            self.sim.prefill_q.push_retry(h.req, (h.req, None))
        return len(victims)


def shape_step(worker, order: list, decoding: int, step_tokens: int, cap: int, background: int, held: int):
    """The engine's step shape by tier (`scheduler.step_budget.next_step`, as the live vLLM scheduler hook):
    the prompts that take part in the step (looser-tier ones sit out while it holds them back), its
    budget and per-request cap, and the count of steps in a row that held prompts back."""
    sim = worker.sim
    urgent, now = sim.urgent_priority, sim.loop.now
    if any(h.req.priority <= urgent for h in order):
        worker.last_urgent = now
    if not expecting_urgent(worker.last_urgent, now):
        background = 0
    shape = next_step([(h.req.priority, h.req.prompt_tokens - h.done) for h in order], decoding,
                      urgent_priority=urgent, step_tokens=step_tokens, prefill_cap=cap, background=background,
                      held=held, max_held=sim.max_held_steps)
    if shape.hold_background:
        started_looser = any(h.done > h.req.cached_tokens and h.req.priority > urgent for h in order)
        order = [h for h in order if h.req.priority <= urgent]
        held = held + 1 if started_looser else 0
    else:
        held = 0
    return order, shape.tokens, shape.prefill_cap, held


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
