"""Fleet-level preemption and shielded claims in the simulator: the live worker's rules, on virtual time.

A worker holding prompts (a prefill worker's prompts, or the prompts a decode
worker computes itself) asks `scheduler.preemption.victims` what the live
worker (`WorkerRuntime.victims_for`) asks: full prompt length as the remaining
work, its tier rank, deadline and preemptions so far, and the worker's prefill
rate (`scheduler.throughput.rate_or_prior` of its meter, read once per
heartbeat, as the fleet view refreshes it). Live, this runs when a request is
claimed and, while the worker is full, for the EDF head of its stage every
`scheduler.claiming.RECHECK_S`. A worker that preempted is shielded
(`scheduler.claiming.ClaimShield`): it claims only the protected tiers until
their work here is done, or their deadline passes.

Who claims first (`scheduler.claiming.claim_defer_s`, as the live `WorkerRuntime._claim_defer`): a
worker whose engine computes prompts waits before claiming one more prompt (`claim_defer`, on the
entry `peek_for` shows it) when a peer of the prompt's stage, as its last heartbeat said
(`Simulation.freest`), is free of its own prompts sooner: for the difference, so that an engine computing
less claims it first. Its own time is the tokens left as the live vLLM worker estimates them
(`scheduler.claiming.tokens_left` from the claims' times at its measured rate: vLLM does not report a
prompt's progress). A KV hand-off, a tier stricter than anything computing, or a prompt no peer would
take sooner is claimed at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyline.scheduler.claiming import claim_defer_s, tokens_left
from skyline.scheduler.preemption import Waiting, victims
from skyline.scheduler.throughput import rate_or_prior
from skyline.tools.simulate.request import SimRequest

if TYPE_CHECKING:
    from skyline.tools.simulate.decode_worker import DecodeWorker
    from skyline.tools.simulate.prefill_worker import PrefillWorker
    from skyline.tools.simulate.queues import StageQueues


def measured_rate(worker: PrefillWorker | DecodeWorker) -> float:
    """The worker's prefill tokens/s: its meter, re-read once per heartbeat; the prior before any sample."""
    sim = worker.sim
    now = sim.loop.now
    at, rate = worker.rate_cache
    if now - at >= sim.worker_cfg.heartbeat_s:
        rate = worker.meter.tokens_per_s(int(now * 1000)) or 0.0
        worker.rate_cache = (now, rate)
    return rate_or_prior(rate, sim.worker_cfg.prior_prefill_tokens_per_s)


def victims_for(worker: PrefillWorker | DecodeWorker, held: list, head: SimRequest, claimed: bool = True) -> list:
    """The handles in `held` (each with `.req`) to abort so that request `head` can meet its deadline,
    in the order the live worker aborts (and so re-queues) them; each victim's request is counted as
    preempted once more, and the worker shields `head`'s tiers when there are any."""
    sim = worker.sim
    if not held or len(sim.ranks_seen) < 2:
        return []  # (one tier in the whole workload: nothing can ever be preempted; the hot path)
    deadline_ms = int(head.deadline * 1000)
    chosen = victims(worker.preemption,
                     [(h.req.rank, int(h.req.deadline * 1000), h.req.prompt_tokens, h.req.preemptions) for h in held],
                     Waiting(head.rank, deadline_ms, head.prompt_tokens), int(sim.loop.now * 1000),
                     lambda: measured_rate(worker), claimed)
    if not chosen:
        return []
    worker.claims.preempted_for(head.rank, deadline_ms)
    out = [held[i] for i in chosen]
    for h in out:
        h.req.preemptions += 1
        sim.counters["preempted"] += 1
    return out


def claim_for(worker: PrefillWorker | DecodeWorker, q: StageQueues, held: list) -> tuple | None:
    """The next entry of stage queues `q` the worker may take, or None: only work placed for other
    workers waits, within its bound (`claim_as`), or its shield holds and only looser tiers wait
    (`scheduler.claiming.ClaimShield`, as the live worker's claim loop): expired, or with none of its
    tiers computing among the handles in `held`, the shield lifts."""
    gate = worker.claims
    rate = measured_rate(worker)  # heads are compared by latest start at it (scheduler.edf.start_by_ms)
    skip = worker.leave_for(q)  # heads an elastic worker leaves to its peers until due (the general path)
    if gate.shield is None:
        # Work placed for workers' prefix caches waits (the lane rule decides), or heads are left to peers.
        if q.placed_size or skip is not None:
            return q.claim_as(worker.name, int(worker.sim.loop.now * 1000), None, rate, skip)
        return q.claim(None, rate)  # (the hot path: no shield up)
    while True:
        max_rank = gate.max_rank(int(worker.sim.loop.now * 1000))
        if q.placed_size or skip is not None:
            item = q.claim_as(worker.name, int(worker.sim.loop.now * 1000), max_rank, rate, skip)
        else:
            item = q.claim(max_rank, rate)
        if item is not None or max_rank is None:
            return item
        if not gate.found_nothing(h.req.rank for h in held):
            return None


def peek_for(worker: PrefillWorker | DecodeWorker, q: StageQueues, held: list) -> tuple | None:
    """The entry `claim_for` would give the worker now, left in the queue (None: it would get none): what
    the live worker's claim loop peeks before it decides how long to wait (`claim_defer`). A shield that
    finds none of its tiers computing lifts here, as the claim would lift it."""
    gate = worker.claims
    now_ms = int(worker.sim.loop.now * 1000)
    rate = measured_rate(worker)
    skip = worker.leave_for(q)
    general = q.placed_size or skip is not None
    if gate.shield is None:
        return q.peek_as(worker.name, now_ms, None, rate, skip) if general else q.peek(None, rate)
    while True:
        max_rank = gate.max_rank(now_ms)
        item = q.peek_as(worker.name, now_ms, max_rank, rate, skip) if general else q.peek(max_rank, rate)
        if item is not None or max_rank is None:
            return item
        if not gate.found_nothing(h.req.rank for h in held):
            return None


def claim_defer(worker: PrefillWorker | DecodeWorker, q: StageQueues, item: tuple, held: list) -> float:
    """Seconds the worker waits before claiming entry `item` of stage queues `q` (`scheduler.claiming.
    claim_defer_s`), its engine computing the prompts of handles `held` (each with `.req` and `.claimed_at`)
    at its prefill rate (`measured_rate`, as its preemption asks), against the freest peer of the stage as
    the heartbeats said (`Simulation.freest`): the live `WorkerRuntime._claim_defer`. 0: claim it now."""
    sim = worker.sim
    if item[1] is not None:
        return 0.0  # KV to pull (no prompt to compute): the rate is not asked, as live
    if not held:
        return worker.idle_claim_defer(q)  # an elastic worker's streams may weigh a long prompt
    peer_free_s = sim.freest.free_s(worker.name, q.stage, sim.loop.now)
    if peer_free_s is None:
        return 0.0  # no peer would take it sooner
    req: SimRequest = item[0]
    rate = measured_rate(worker)
    return claim_defer_s(req.backlog_tokens, req.rank, left_tokens(worker, held, rate), [h.req.rank for h in held],
                         rate, peer_free_s, sim.worker_cfg.claim_defer_max_s)


def left_tokens(worker: PrefillWorker | DecodeWorker, held: list, rate: float) -> int:
    """Prompt tokens the worker's engine has yet to compute of the prompts of handles `held`, at `rate`
    (`scheduler.claiming.tokens_left`; the simulated engine does not report progress): what its claim defer
    weighs and its heartbeat tells its peers', as the live `WorkerRuntime._left_tokens`."""
    return tokens_left([(h.req.prompt_tokens, h.claimed_at, None) for h in held], rate, worker.sim.loop.now)
