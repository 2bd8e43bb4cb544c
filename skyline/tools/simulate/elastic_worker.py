"""A simulated elastic worker: one engine that takes either phase, as `skyline worker elastic` does.

It is a decode worker (continuous batching, prompts computed in mixed steps beside its streams)
that also consumes the prefill stage, claiming from the two stages in one earliest-latest-start-first
order (`scheduler.elastic.stage_due_first` on `scheduler.edf.start_by_ms`, the rule of the live
`skyline/core/stage_queues.py`).
For a prompt it claims from the prefill stage it asks `scheduler.elastic.decoder_for` where the
decode runs, as `workers/runtime.py` `_place_decode` does: here (the prompt is served whole, no KV
moves) or on a peer, whose affinity lane of the decode stage gets the hand-off for
`HANDOFF_HOLD_MS` (the fleet's `hand_off`). It reads its peers as their last heartbeat said
(`Simulation.peers`, refreshed every simulated second) and the fleet's prefill backlog as of then.
Short prompts come on the decode stage (the gateway's colocated route, `scheduler/disagg.py`) and
are served whole by whoever claims them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyline.scheduler.claiming import computes_long, leaves_until_due, long_prompt_defer_s
from skyline.scheduler.elastic import MixWindow, decoder_for, handoff_step_tokens, has_room, stage_due_first
from skyline.tools.simulate.decode_worker import DecodeWorker
from skyline.tools.simulate.preempt import measured_rate
from skyline.tools.simulate.request import SimRequest

if TYPE_CHECKING:
    from skyline.tools.simulate.fleet import Simulation
    from skyline.tools.simulate.queues import Skip, StageQueues


class ElasticWorker(DecodeWorker):
    def __init__(self, sim: Simulation, wid: int):
        super().__init__(sim, wid)
        self.name = f"elastic-{wid}"
        self.last_long_s: float | None = None  # when its engine last computed a long prompt (`computes_long`)
        self.mix = MixWindow()  # the prompt tokens it claimed lately, long and short (its heartbeat's)

    def may_find_work(self) -> bool:
        """As a decode worker's, and a head of the prefill stage left to a peer (`leave_for`) may be its
        to claim once its engine idles."""
        return self.work_waiting() or not self.in_ready

    def work_waiting(self) -> bool:
        sim = self.sim
        return sim.decode_q.size > 0 or sim.prefill_q.size > 0

    def queue_to_claim(self) -> StageQueues | None:
        """The stage whose head it may claim is due first (the decode stage's among equals); None when
        it may claim nothing: only work placed for others within its hold, or its shield holds."""
        sim = self.sim
        now_ms = int(self.loop.now * 1000)
        gate = self.claims
        max_rank = gate.max_rank(now_ms) if gate.shield is not None else None
        rate = measured_rate(self)  # heads are compared by latest start (scheduler.edf.start_by_ms)
        while True:
            dues: dict[str, int] = {}
            for stage, q in (("decode", sim.decode_q), ("prefill", sim.prefill_q)):
                if not q.size:
                    continue
                skip = self.leave_for(q)
                due = q.due_for(self.name, now_ms, max_rank, rate, skip)
                if skip is not None:
                    head = q.due_for(self.name, now_ms, max_rank, rate)
                    if head is not None and head != due and head > now_ms:
                        # Its head is left to peers: look again when due. (One left past its latest start
                        # waits for this engine's long prompt, whose end wakes it.)
                        self.wake_when_due(head)
                if due is not None:
                    dues[stage] = due
            first = stage_due_first(dues)
            if first is not None:
                return sim.decode_q if first == "decode" else sim.prefill_q
            # Nothing of the shielded tiers: the shield lifts when none of them computes here.
            if max_rank is None or not gate.found_nothing(h.req.rank for h in self.local):
                return None
            max_rank = None

    def leave_for(self, q: StageQueues) -> Skip | None:
        """The heads of `q` it leaves to its peers until they must start (`claiming.leaves_until_due`; live:
        `WorkerRuntime._leaves`): short prompts while long prompts gather on its engine and not on a peer's
        free by the head's latest start that holds fewer requests; long prompts while they gather on a
        peer's free by then and not here; with the phase mix (`[worker] phase_mix`), the other kind's prompts
        to a peer of that kind with room, whenever they are due. None: it
        leaves none (and always with both the phase mix and `[worker] long_prompt_memory_s` off)."""
        sim = self.sim
        split = sim.worker_cfg.phase_mix
        if not split and sim.worker_cfg.long_prompt_memory_s <= 0:
            return None
        long_here = self.computes_long()
        idle = self.B == 0 and not self.arriving and not self.joining and not self.local  # (its last step may still run)
        with_long = None if long_here else sim.freest.free_at_with_long(self.name, "prefill")
        without_long = sim.freest.least_held_without_long(self.name, "decode") if long_here else None
        if with_long is None and without_long is None:
            return None
        stage = "decode" if q is sim.decode_q else "prefill"
        held = self.B + self.arriving + len(self.local) + len(self.joining)  # as its heartbeat counts them
        return lambda item, start_by_ms, due: leaves_until_due(
            stage, item[0].backlog_tokens if item[1] is None else 0, start_by_ms / 1000, long_here=long_here,
            held_here=held, free_at_with_long=with_long, without_long=without_long, due=due, split=split,
            idle_here=idle)

    def computes_long(self) -> bool:
        """Do long prompts (the prefill stage's) gather on its engine (`claiming.computes_long`; live:
        `WorkerRuntime._computes_long`)? With the phase mix: is it one of the fleet's long engines?"""
        if self.sim.worker_cfg.phase_mix:
            return self.name in self.sim.long_set
        if self.sim.worker_cfg.long_prompt_memory_s <= 0:
            return False
        now = self.loop.now
        if any(h.queue is self.sim.prefill_q for h in self.local):
            self.last_long_s = now
        return computes_long(self.last_long_s, now, self.sim.worker_cfg.long_prompt_memory_s)

    def may_defer(self) -> bool:
        """Its engine computes prompts, or decodes streams that a long prompt would slow
        (`claiming.long_prompt_defer_s`)."""
        return self.defers and (self.local_tokens > 0 or self.streams() > 0)

    def idle_claim_defer(self, q: StageQueues) -> float:
        """Computing no prompt: a long prompt (the prefill stage's) waits for an idle peer decoding fewer
        streams (`claiming.long_prompt_defer_s`; live: `WorkerRuntime._claim_defer`)."""
        sim = self.sim
        if q is not sim.prefill_q:
            return 0.0
        return long_prompt_defer_s(self.streams(), sim.freest.fewest_streams(self.name, "prefill"),
                                   sim.worker_cfg.claim_defer_max_s)

    def streams(self) -> int:
        """Requests decoded here or to be (live: held with serve_as "decode"), what `decoder_for` weighs."""
        return self.B + self.arriving + len(self.joining) + sum(1 for h in self.local if h.hand_to is None)

    def take(self, item: tuple, q: StageQueues, now: float) -> None:
        sim = self.sim
        req: SimRequest = item[0]
        if item[1] is None:  # a prompt to compute (live: `WorkerRuntime._start`)
            self.mix.add(now, req.prompt_tokens, long=q is sim.prefill_q)
        if q is not sim.prefill_q:
            super().take(item, q, now)  # decode stage: a hand-off to pull, or a short prompt served whole
            return
        # `_place_decode`: prompts are queued for the fleet when its prefill backlog (as of the heartbeat)
        # holds more than this worker's own prompts of that stage.
        mine = req.backlog_tokens + sum(h.req.backlog_tokens for h in self.local if h.queue is q)
        peer, why = decoder_for(self.name, self.streams(), sim.peers, sim.seen_prefill_backlog > mine,
                                sim.worker_cfg.prefill_token_budget, spread=str(req.index),
                                step_tokens=self.perf.max_step_tokens, prompt_tokens=req.prompt_tokens,
                                min_move_tokens=sim.disagg.min_remote_prefill_tokens, long_here=sim.long_set)
        if peer is not None and not has_room(sim.beat_now(peer), sim.worker_cfg.prefill_token_budget,
                                             handoff_step_tokens(why, self.perf.max_step_tokens)):
            peer, why = None, "peer_busy_now"  # live: `WorkerRuntime._confirm_decoder`, on the peer's newest beat
        sim.counters[why] = sim.counters.get(why, 0) + 1
        if peer is None:
            super().take(item, q, now)  # served whole: computed and decoded here
            return
        self.reserved += req.prompt_tokens  # its blocks stay in this engine until the peer pulls them
        self.compute_here(req, q, peer, now)


class BothStages:
    """The head due first over both stages' queues, which a full elastic worker's preemption check
    reads (live: `StageQueues.peek_heads`)."""

    def __init__(self, prefill_q: StageQueues, decode_q: StageQueues):
        self.prefill_q, self.decode_q = prefill_q, decode_q

    def head(self) -> tuple | None:
        heads = {"decode": self.decode_q.head(), "prefill": self.prefill_q.head()}
        stage = stage_due_first({s: int(e[0].deadline * 1000) for s, e in heads.items() if e is not None})
        return None if stage is None else heads[stage]
