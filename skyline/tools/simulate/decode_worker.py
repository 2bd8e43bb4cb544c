"""A simulated decode worker: continuous batching advanced in closed form.

Claiming is the live rule (`scheduler.claiming.ClaimRoom.decode`, as `workers/runtime.py`): claim the
EDF head of the decode stage while the worker holds fewer than `max_running` requests, its KV usage is
under `kv_watermark` and its streams keep their pace. A claimed request with a KV handle pulls
its KV (the model's transfer time) and joins the batch at the next step
boundary; one without (colocated route, or a handle too old: `scheduler.disagg.handle_expired`)
is prefilled by this engine first.

Decode-only batches are not simulated step by step. Between two membership
changes the batch of B sequences holding C KV tokens runs steps of
a + b * (C + j * B) seconds (the model's linear-in-context cost), so the
time after n steps is

    T(n) = t + n a + b (n C + B n (n - 1) / 2)

and the worker schedules one event: the step at which its next member
finishes. A request joining mid-step waits for the step in progress (found
by solving T(n) <= now for n); every member's first and last token times
follow from T. Steps that prefill (colocated engines) are simulated one by
one: a mixed step computes prompt chunks and one token per running sequence.

Prompts computed here hold the step budget as a prefill worker's do, so the
live rules apply to them: claims stop at `prefill_token_budget` prompt
tokens in the engine, and fleet-level preemption (`preempt.py`) aborts
looser-tier ones for a request that would miss its deadline (at its claim,
and for the stage's EDF head while the worker is full).
While it computes prompts, it waits before claiming one more when a peer
would be free sooner (`scheduler.claiming.claim_defer_s`, `preempt.claim_defer`;
live: `TierQueues.claim` sleeps), out of the ready queue, then claims what is
due; it stops waiting when one of its prompts gets its first token or is
preempted (live: `HeldTable.freed` wakes the claim loop).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING, Any

from skyline.scheduler.claiming import ClaimShield
from skyline.scheduler.decode_room import TokenPaceMeter, pace_allows, paced_claim_due
from skyline.scheduler.disagg import handle_expired
from skyline.scheduler.step_budget import StepShaper
from skyline.scheduler.throughput import ThroughputMeter
from skyline.tools.simulate.preempt import claim_defer, claim_for, measured_rate, peek_for, victims_for
from skyline.tools.simulate.prefill_worker import plan_chunks, shape_step
from skyline.tools.simulate.request import SimRequest

if TYPE_CHECKING:
    from skyline.tools.simulate.fleet import Simulation
    from skyline.tools.simulate.prefill_worker import PrefillWorker
    from skyline.tools.simulate.prefix_cache import PrefixCache
    from skyline.tools.simulate.queues import Skip, StageQueues

PACE_READ_S = 0.5  # the pace rule's verdict is re-read at most this often (its window is 10 s)


class _Member:
    __slots__ = ("end_step", "first_step", "req")

    def __init__(self, req: SimRequest, first_step: int, end_step: int):
        self.req, self.first_step, self.end_step = req, first_step, end_step


class _Local:
    __slots__ = ("aborted", "claimed_at", "done", "hand_to", "order", "queue", "req")

    def __init__(self, req: SimRequest, order: int, now: float, queue: StageQueues, hand_to: str | None):
        # a prefix-cache hit: the engine computes only the rest
        self.req, self.done, self.order, self.claimed_at, self.aborted = req, req.cached_tokens, order, now, False
        self.queue = queue  # the stage it was claimed from: where it goes back if preempted, whose backlog it is
        self.hand_to = hand_to  # an elastic worker's choice: the peer that decodes it (None: decoded here)


class DecodeWorker:
    def __init__(self, sim: Simulation, wid: int):
        self.sim, self.wid = sim, wid
        self.name = f"decode-{wid}"
        self.perf = sim.perf_decode
        # the current segment: boundary after step k at time t, B members holding C KV tokens
        self.k: int = 0
        self.t: float = 0.0
        self.C: int = 0
        self.B: int = 0
        self.a: float = 0.0
        self.b: float = 0.0
        self.ends: list[tuple[int, int, _Member]] = []  # heap of (end_step, seq, member)
        self._seq = 0
        self.pending_first: list[_Member] = []  # joined at this boundary: first token at step k + 1
        # The next member's completion: `due` is when it happens (None: no closed-form batch), `armed`
        # the time of the one wake-up event that counts (see _reschedule).
        self.due: float | None = None
        self.armed: float | None = None
        self.arriving = 0  # claimed, KV on its way
        self.reserved = 0  # KV tokens of claimed requests not yet in the batch
        self.local: list[_Local] = []  # prompts this engine prefills itself (colocated)
        self.local_tokens = 0  # their prompt tokens: claims stop at the prefill token budget
        self.joining: list[SimRequest] = []  # KV arrived while stepping: join at the next step
        self.stepping = False
        self.in_ready = False  # waiting for work in the stage's ready queue (a blocked XREADGROUP)
        self._order = 0
        self.segments: list | None = [] if sim.record_itl else None
        # Prompts this worker computed itself, timed as the live decode worker times them
        # (claim -> first token); heartbeated for admission control of colocated routes.
        self.meter = ThroughputMeter()
        self.rate_cache = (-1.0, 0.0)  # (read at, tokens/s) at the last heartbeat
        # The prefill worker sharing this host's cores (Simulation.shared_host).
        self.neighbour: PrefillWorker | None = None
        self.room = sim.claim_room
        self.preemption = sim.decode_preemption  # the policy with this engine's step shape
        self.claims = ClaimShield()  # after a preemption: claim only the protected tiers for a while
        self.shaper = StepShaper(urgent_priority=sim.urgent_priority, step_tokens=self.perf.max_step_tokens,
                                 prefill_cap=sim.decode_cap, background=sim.decode_background,
                                 max_held=sim.max_held_steps)
        # The claim rule's pace check (scheduler/decode_room.py): TPOT targets of the requests held
        # (target -> count), and the streams' time per token in the live worker's meter
        # (`TokenPaceMeter`). Live, the meter takes every stream's gap between two chunks; here the
        # steps add to two running sums (stream-seconds, tokens), and what they added since the last
        # read goes into the meter as one sample when the rule is read.
        self.headroom = sim.worker_cfg.tpot_headroom
        self.pace = TokenPaceMeter(sim.worker_cfg.tpot_window_s)
        self.tpot_held: dict[int, int] = {}
        self.stream_s = 0.0
        self.tokens_out = 0
        self._paced = (0.0, 0)  # the sums when the meter last took them
        self.pace_ok, self.pace_at = True, -1.0  # the verdict for a worker holding 2 or more, and when read
        self.kv_capacity = self.perf.kv_capacity_tokens
        self._room = self.room.decode  # (bound once: asked after every batch event)
        self._coeffs = self.perf.decode_coeffs
        self.loop = sim.loop
        self._complete_cb = self._on_complete  # bound once: scheduled after every batch change
        self.cache: PrefixCache | None = None  # its engine's prefix cache, when the fleet models one
        # Waiting out a claim defer (`claim_wait`; live: its claim loop sleeps), on which stage's queues,
        # and which sleep (a wake-up of an earlier one, cut short, finds another number).
        self.asleep = False
        self.sleep_q: StageQueues | None = None
        self.sleeps = 0
        # Paced out, or leaving a head to its peers: when the head it saw must start (`wake_when_due`)
        self.due_wake_at: float | None = None
        self.defers = sim.worker_cfg.claim_defer_max_s > 0

    # -- room and claims ---------------------------------------------------------------

    def has_room(self) -> bool:
        # KV usage counts the KV of claimed requests still on their way: the engine holds their blocks.
        return self._room(self.B + self.arriving + len(self.local) + len(self.joining), self.local_tokens,
                          (self.C + self.reserved) / self.kv_capacity, self.pace_ok)

    def _read_pace(self) -> None:
        """The pace rule's verdict, re-read at the worker's step and batch events at most every
        PACE_READ_S simulated seconds (callers check; has_room uses it meanwhile): a claim needs no
        more precision on a 10 s window, and a big fleet asks millions of times."""
        now = self.pace_at = self.loop.now
        s0, n0 = self._paced
        s1, n1 = self._paced = (self.stream_s, self.tokens_out)
        self.pace.record(now, s1 - s0, n1 - n0)
        tightest = min(self.tpot_held) if self.tpot_held else None
        self.pace_ok = pace_allows(self.pace.seconds_per_token(now), tightest, self.headroom)

    def claim_while_room(self, limit: int = 1 << 30, woke: bool = False) -> None:
        """Claim up to `limit` entries while there is room; then wait in the ready queue if room is left.
        A claim its engine's prompts defer (`claim_wait`) waits: the worker sleeps, out of the ready queue,
        and claims when it wakes (`woke`: this call is that claim, not deferred again)."""
        if self.asleep:
            return  # its claim loop sleeps: it claims when it wakes
        sim = self.sim
        now = sim.loop.now
        room = None  # has_room() as last asked, while nothing changed since (None: ask again)
        while self.work_waiting() and limit > 0:
            room = self.has_room()
            if room:
                q = self.queue_to_claim()
            else:
                q = self.paced_due()
                if q is None:
                    break
            if room and self.local_tokens and not woke and q is not None:
                wait = self.claim_wait(q)
                if wait is not None:
                    self._sleep(q, wait[2])
                    return
            woke = False
            item = claim_for(self, q, self.local) if q is not None else None
            if item is None:  # shielded and only looser tiers wait, or only work placed for others
                if self.claims.shield is not None:
                    return  # out of the ready queue: nothing there is its to take; its own steps claim again
                break
            room = None
            limit -= 1
            self.take(item, q, now)  # type: ignore[arg-type]
        # Back in the ready queue while it has room (called after every batch event)
        if not self.in_ready and (self.has_room() if room is None else room):
            self.in_ready = True
            sim.decode_ready.append(self)

    def paced_due(self) -> StageQueues | None:
        """For a worker the pace rule alone keeps from claiming (every other limit open): the stage queue whose
        head must start by now to meet its deadline (`scheduler.decode_room.paced_claim_due`), claimed without a
        defer; None when there is none, and then it looks again when the head it saw must start. Live:
        `WorkerRuntime.paced_out` and the claim's `due_by_ms`, looked at every RECHECK_S; here at each of its
        step and batch events and at that time (an entry that arrives meanwhile is seen at the next of them:
        a timer per arrival and paced worker would cost a large fleet more than its steps)."""
        if self.pace_ok or not self._room(self.B + self.arriving + len(self.local) + len(self.joining),
                                          self.local_tokens, (self.C + self.reserved) / self.kv_capacity, True):
            return None
        q = self.queue_to_claim()
        if q is None:
            return None
        now_ms = int(self.loop.now * 1000)
        gate = self.claims
        key = q.due_for(self.name, now_ms, gate.max_rank(now_ms) if gate.shield is not None else None,
                        measured_rate(self))
        if key is None:
            return None
        if paced_claim_due(key, now_ms):
            return q
        self.wake_when_due(key)
        return None

    def wake_when_due(self, key_ms: int) -> None:
        """Look at the queues again when a head seen now must start (`key_ms`, its latest start): a paced-out
        worker (`paced_due`), or an elastic one that leaves the head to its peers until then."""
        at = (key_ms + 0.5) / 1000  # (half a ms on: the clock read then is `key_ms` ms, whatever the rounding)
        if self.due_wake_at is None or at < self.due_wake_at:
            self.due_wake_at = at
            self.loop.at(at, self._due_wake, at)

    def _due_wake(self, at: float) -> None:
        """The head it saw must start now (`wake_when_due`); a wake-up superseded by an earlier one does
        nothing (that one looked, and armed the next)."""
        if self.due_wake_at != at:
            return
        self.due_wake_at = None
        self.claim_while_room()

    def leave_for(self, q: StageQueues) -> Skip | None:
        """The heads of `q` it leaves to its peers until they must start (`ElasticWorker`); None: none."""
        return None

    def claim_wait(self, q: StageQueues | None = None) -> tuple | None:
        """(stage queue, entry, seconds) when the worker's next claim, from `q` (default: the stage it would
        claim from), waits before it is made (`preempt.claim_defer`: its engine computes prompts); None when
        it claims at once."""
        if not self.may_defer():
            return None
        if q is None:
            q = self.queue_to_claim()
            if q is None:
                return None
        item = peek_for(self, q, self.local)
        if item is None:
            return None
        wait = claim_defer(self, q, item, self.local)
        return (q, item, wait) if wait > 0 else None

    @property
    def computing_tokens(self) -> int:
        """Prompt tokens its engine computes: what the claim defer weighs."""
        return self.local_tokens

    def wait_for(self, q: StageQueues, item: tuple) -> float:
        """Seconds the worker would wait before claiming entry `item` of `q` (0: it claims it now)."""
        return claim_defer(self, q, item, self.local) if self.may_defer() else 0.0

    def may_defer(self) -> bool:
        """Could its next claim wait (`preempt.claim_defer`)? Its engine computes prompts."""
        return self.defers and self.local_tokens > 0

    def idle_claim_defer(self, q: StageQueues) -> float:
        """The claim defer of a worker whose engine computes no prompt: none (`ElasticWorker`: a long prompt)."""
        return 0.0

    def _sleep(self, q: StageQueues, wait: float) -> None:
        """Wait `wait` s before the next claim (live: `TierQueues.claim` sleeps), out of the ready queue."""
        self.asleep = True
        self.sleep_q = q
        self.sleeps += 1
        q.deferring += 1
        if self.in_ready:
            self.in_ready = False
            self.sim.decode_ready.remove(self)
        self.loop.after(wait, self._wake, self.sleeps)

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
        """A prompt of its engine has its first token, is handed off or preempted: a worker waiting out a
        defer claims now (live: `HeldTable.freed` wakes its claim loop)."""
        if self.asleep:
            self._wake(self.sleeps)

    def work_waiting(self) -> bool:
        """Is anything queued in the stages it consumes (an elastic worker: both)?"""
        return self.sim.decode_q.size > 0

    def queue_to_claim(self) -> StageQueues | None:
        """The stage queue its next claim takes from (an elastic worker: the one due first)."""
        return self.sim.decode_q

    def take(self, item: tuple, q: StageQueues, now: float) -> None:
        """Start a claimed entry: pull its KV (joining the batch when it arrives), or compute its prompt here."""
        req: SimRequest = item[0]
        prefill_end: float | None = item[1]
        self.reserved += req.prompt_tokens
        if self.headroom > 0:
            self.tpot_held[req.tpot_ms] = self.tpot_held.get(req.tpot_ms, 0) + 1
        if prefill_end is not None and req.prefilled_by == self.name:
            # An elastic worker's own hand-off, taken back: its blocks are in this engine (live: its
            # prefix cache, workers/decode.py `own_handoff`), nothing moves.
            self.arriving += 1
            self.loop.after(0.0, self._kv_arrived, req)
        elif prefill_end is not None and not handle_expired((now - prefill_end) * 1000, self.sim.kv_lease_s):
            self.arriving += 1
            self.loop.after(self.perf.kv_transfer_s(req.prompt_tokens), self._kv_arrived, req)
        else:
            self.compute_here(req, q, None, now)

    def compute_here(self, req: SimRequest, q: StageQueues, hand_to: str | None, now: float) -> None:
        """Compute the prompt of `req` (claimed from `q`) in this engine's steps, beside its streams."""
        self.preempt(req)  # live: a prompt computed here competes for the step budget
        if self.cache is not None and req.chain is not None:
            req.cached_tokens = self.cache.hit(req)  # the engine computes only the rest
        self._order += 1
        self.local.append(_Local(req, self._order, now, q, hand_to))
        self.local_tokens += req.prompt_tokens
        if not self.stepping:
            self._align(now)
            self.stepping = True
            self.due = None  # the wake-up armed for the closed-form batch finds nothing due
            self._start_mixed()

    def preempt(self, head: SimRequest, claimed: bool = True) -> int:
        """Abort the prompts that keep request `head` from its deadline (requeued); how many.
        `claimed`: this worker just took `head` (False: still queued, the worker full)."""
        victims = victims_for(self, self.local, head, claimed)
        for h in victims:
            h.aborted = True  # the step in progress computes its chunk for nothing
            self.local.remove(h)
            self.local_tokens -= h.req.prompt_tokens
            self.reserved -= h.req.prompt_tokens
            if h.hand_to is None:
                self._release_tpot(h.req)
            h.queue.push_retry(h.req, (h.req, None))  # back on its stage's retry lane, to be prefilled again
        if victims and self.asleep:
            self._freed()
        return len(victims)

    def _kv_arrived(self, req: SimRequest) -> None:
        self.arriving -= 1
        if self.stepping:
            self.joining.append(req)
            return
        self._align(self.loop.now)
        self._join(req)
        self._reschedule()
        if self.may_find_work():  # (else claim_while_room has nothing to do)
            self.claim_while_room()  # members that finished at the boundary made room

    # -- closed-form batch ---------------------------------------------------------------

    def _align(self, now: float) -> None:
        """Move the boundary to where a change made at `now` takes effect: the end of the step in progress."""
        t, B = self.t, self.B
        if B == 0:
            self.t = max(t, now)  # an idle engine starts at once
            return
        if now <= t:
            return  # already at a (future) boundary
        # The whole steps done by `now` (T(n) <= now), then the step in progress (once per KV arrival)
        a, b, C = self.a, self.b, self.C
        alpha, beta = b * B / 2, a + b * C - b * B / 2
        if alpha <= 0:
            n = int((now - t) / beta) if beta > 0 else 0
        else:
            n = int((-beta + math.sqrt(beta * beta + 4 * alpha * (now - t))) / (2 * alpha))
        while t + (n + 1) * a + b * ((n + 1) * C + B * (n + 1) * n / 2) <= now:  # T(n + 1)
            n += 1
        while n > 0 and t + n * a + b * (n * C + B * n * (n - 1) / 2) > now:  # T(n)
            n -= 1
        self._advance(n if t + n * a + b * (n * C + B * n * (n - 1) / 2) == now else n + 1)

    def _advance(self, n: int) -> None:
        if n <= 0:
            return
        t, B, a, b, C = self.t, self.B, self.a, self.b, self.C
        if self.pending_first:
            first = t + a + b * C  # T(1)
            for m in self.pending_first:
                m.req.first_t = first
            self.pending_first.clear()
        if self.segments is not None:
            self.segments.append((self.k, t, C, B, a, b))
        t_new = t + n * a + b * (n * C + B * n * (n - 1) / 2)  # T(n)
        self.stream_s += (t_new - t) * B  # n steps of B streams: B tokens per step
        self.tokens_out += n * B
        k = self.k = self.k + n
        self.C += B * n
        self.t = t_new
        ends = self.ends
        while ends and ends[0][0] <= k:
            self._leave(heapq.heappop(ends)[2], t_new)

    def _release_tpot(self, req: SimRequest) -> None:
        if self.headroom <= 0:
            return
        n = self.tpot_held[req.tpot_ms] - 1
        if n:
            self.tpot_held[req.tpot_ms] = n
        else:
            del self.tpot_held[req.tpot_ms]

    def _leave(self, m: _Member, t_done: float) -> None:
        req = m.req
        self.B -= 1
        self.C -= req.prompt_tokens + req.max_tokens
        req.done_t = t_done
        if self.cache is not None and req.chain is not None:
            self.cache.finished(req)  # its prompt's and answer's blocks stay cached
        if self.segments is not None:
            req.itl_s = self._itls(m.first_step, m.end_step)
        if self.headroom > 0:  # _release_tpot, inlined
            n = self.tpot_held[req.tpot_ms] - 1
            if n:
                self.tpot_held[req.tpot_ms] = n
            else:
                del self.tpot_held[req.tpot_ms]
        self.sim.on_done(req)

    def _join(self, req: SimRequest, produced: int = 0) -> None:
        """Add a member at the current boundary; `produced` = tokens it already has (1 after a local prefill)."""
        self.reserved -= req.prompt_tokens
        first_step = self.k + 1 - produced
        end_step = first_step + req.max_tokens - 1
        if end_step <= self.k:  # a one-token request finished with its prefill
            req.done_t = req.first_t
            if self.cache is not None and req.chain is not None:
                self.cache.finished(req)
            self._release_tpot(req)
            self.sim.on_done(req)
            return
        m = _Member(req, first_step, end_step)
        self._seq += 1
        heapq.heappush(self.ends, (end_step, self._seq, m))
        self.B += 1
        self.C += req.prompt_tokens + produced
        if not produced:
            self.pending_first.append(m)

    def may_find_work(self) -> bool:
        """Might a look at the queues now find something to claim (else it waits in the ready queue, where
        an arrival wakes it)?"""
        return bool(self.sim.decode_q.size) or not self.in_ready

    def busy(self) -> bool:
        return self.stepping or self.B > 0

    def neighbour_changed(self) -> None:
        """The engine sharing this host started or stopped: steps after the one in progress change speed."""
        if self.stepping or self.B == 0:
            return  # stepped mode prices each step when it starts; an idle engine has nothing to rescale
        self._align(self.sim.loop.now)
        self._reschedule()
        self.claim_while_room()

    def _reschedule(self) -> None:
        """Recompute when the next member finishes, after any change to the batch.

        Most changes are joins, which only slow the batch down: the completion
        moves later. Rather than push an event per change (and skip the stale
        ones, a fifth of a big run's events), the worker keeps one wake-up
        armed: it pushes a new one only when the completion moved earlier than
        the armed one, and an early wake-up re-arms for the new time."""
        loop = self.loop
        if self.headroom > 0 and loop.now - self.pace_at >= PACE_READ_S:
            self._read_pace()
        B, C = self.B, self.C
        if B == 0:
            self.due = None
            return
        a, b = self._coeffs(B, C)
        if self.neighbour is not None and self.neighbour.busy():
            a *= self.sim.neighbour_slowdown
            b *= self.sim.neighbour_slowdown
        self.a, self.b = a, b
        n = self.ends[0][0] - self.k
        due = self.due = self.t + n * a + b * (n * C + B * n * (n - 1) / 2)  # T(n)
        armed = self.armed
        if armed is None or due < armed:
            self.armed = due  # a wake-up armed later than this one is now stale
            loop.at(due, self._complete_cb, due)

    def _on_complete(self, at: float) -> None:
        if at != self.armed:
            return  # superseded by an earlier wake-up
        self.armed = None
        due = self.due
        if due is None:
            return  # the batch emptied or went to stepped mode
        if due > at:  # the completion moved later since this wake-up was armed
            self.armed = due
            self.loop.at(due, self._complete_cb, due)
            return
        self._advance(self.ends[0][0] - self.k)
        self._reschedule()
        if self.may_find_work():  # (else claim_while_room has nothing to do)
            self.claim_while_room()

    # -- stepped mode: steps that prefill -------------------------------------------------------

    def _start_mixed(self) -> None:
        for req in self.joining:
            self._join(req)
        self.joining.clear()
        started = [h for h in self.local if h.done > h.req.cached_tokens]
        waiting = sorted((h for h in self.local if h.done == h.req.cached_tokens), key=lambda h: (h.req.priority, h.order))
        order, shape = shape_step(self.shaper, started + waiting, self.B, self.sim)
        budget = shape.tokens - self.B
        held = len(order) + self.B
        chunks, work = plan_chunks(order, budget, shape.prefill_cap if held > 1 else 0)
        if self.B:
            dur = self.perf.mixed_step_s(chunks, self.B, self.C)
        else:
            dur = self.perf.prefill_step_s(chunks)
        if self.neighbour is not None and self.neighbour.busy():
            dur *= self.sim.neighbour_slowdown
        if self.segments is not None:
            self.segments.append((self.k, self.t, 0, 0, dur, 0.0))
        self.sim.loop.at(self.t + dur, self._mixed_done, work)

    def _mixed_done(self, work: list[tuple[_Local, int]]) -> None:
        now = self.sim.loop.now
        for m in self.pending_first:
            m.req.first_t = now
        self.pending_first.clear()
        self.stream_s += (now - self.t) * self.B
        self.tokens_out += self.B
        self.k += 1
        self.C += self.B
        self.t = now
        ends = self.ends
        while ends and ends[0][0] <= self.k:
            self._leave(heapq.heappop(ends)[2], now)
        finished = False
        for h, n in work:
            if h.aborted:
                continue
            h.done += n
            if h.done >= h.req.prompt_tokens:
                self.local.remove(h)
                self.local_tokens -= h.req.prompt_tokens
                self._prompt_done(h, now)
                finished = True
        if self.headroom > 0 and now - self.pace_at >= PACE_READ_S:
            self._read_pace()
        if finished and self.asleep:
            self._freed()  # (it claims as it wakes)
        else:
            self.claim_while_room()
        if self.local or self.joining:
            self._start_mixed()
            return
        self.stepping = False
        if self.B and self.shaper.held:
            self.shaper.shape((), self.B, now)  # the decode-only steps that follow hold nothing back
        self._reschedule()

    def _prompt_done(self, h: _Local, now: float) -> None:
        """Its prompt computed: the request joins the batch with its first token, or goes to the peer an
        elastic worker chose for its decode (its KV handed off there)."""
        req = h.req
        req.prefill_end = now
        # Live (workers/decode.py, at the first token): meter the prompt, and take a colocated
        # prompt (or one from the prefill stage) off the backlog: it is no longer work ahead of anyone.
        self.meter.record(int(h.claimed_at * 1000), int(now * 1000), req.prompt_tokens)
        if req.route == "colocated" or h.queue is not self.sim.decode_q:
            h.queue.release(req.tier, req.backlog_tokens)
        if self.cache is not None and req.chain is not None:
            self.cache.store(req.chain, req.prompt_blocks)  # other prompts may use them from now
        if h.hand_to is not None:
            self.reserved -= req.prompt_tokens
            self.sim.hand_off(req, h.hand_to, self.name)
            return
        req.first_t = now  # the step that finishes a prompt samples its first token
        self._join(req, produced=1)

    # -- per-token times (small runs) ----------------------------------------------------------

    def _itls(self, first_step: int, end_step: int) -> list[float]:
        """Gaps between this member's token times, from the recorded segments (closed form within each)."""
        segs = self.segments
        times = []
        i = len(segs) - 1  # type: ignore[arg-type]
        for step in range(end_step, first_step - 1, -1):
            while i > 0 and segs[i][0] >= step:  # type: ignore[index]
                i -= 1
            k0, t0, c0, b0, a, b = segs[i]  # type: ignore[index]
            n = step - k0
            times.append(t0 + n * a + b * (n * c0 + b0 * n * (n - 1) / 2))
        times.reverse()
        return [y - x for x, y in itertools.pairwise(times)]
