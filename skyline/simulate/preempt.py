"""Fleet-level preemption in the simulator: what `WorkerRuntime._preempt_for` does, on virtual time.

A worker holding prompts (a prefill worker's prompts, or the prompts a decode
worker computes itself) passes them to `scheduler.preemption.choose_victims`
as the live worker does: full prompt length as the remaining work, its tier
rank, deadline and preemptions so far, and the worker's measured prefill rate
(read once per heartbeat, as the fleet view refreshes it). Live, this runs
when a request is claimed and, while the worker is full, for the EDF head of
its stage at 20 Hz. A worker that preempted is shielded (`Shield`): it claims only
the protected tiers until their work here is done, or their deadline passes.
"""

from __future__ import annotations

from skyline.scheduler.preemption import Running, Waiting, choose_victims


def measured_rate(worker) -> float:
    """The worker's prefill tokens/s: its meter, re-read once per heartbeat; the prior before any sample."""
    sim = worker.sim
    now = sim.loop.now
    at, rate = worker.rate_cache
    if now - at >= sim.worker_cfg.heartbeat_s:
        rate = worker.meter.tokens_per_s(int(now * 1000)) or 0.0
        worker.rate_cache = (now, rate)
    return rate or sim.worker_cfg.prior_prefill_tokens_per_s


def victims_for(worker, held: list, head, claimed: bool = True) -> list:
    """The handles in `held` (each with `.req` and a unique `.order`) to abort so that request
    `head` can meet its deadline; each victim's request is counted as preempted once more."""
    sim = worker.sim
    if not held or not sim.preemption.enabled or len(sim.ranks_seen) < 2:
        return []  # (one tier in the whole workload: nothing can ever be preempted)
    rank, cap = head.rank, sim.preemption.max_preemptions
    if not any(h.req.rank > rank and h.req.preemptions < cap for h in held):
        return []  # nothing it may preempt (the hot path: a fleet serving one tier)
    running = [Running(str(h.order), h.req.rank, int(h.req.deadline * 1000), h.req.prompt_tokens, h.req.preemptions)
               for h in held]
    waiting = Waiting(head.rank, int(head.deadline * 1000), head.prompt_tokens)
    chosen = set(choose_victims(worker.preemption, running, waiting, int(sim.loop.now * 1000), measured_rate(worker),
                                claimed))
    victims = [h for h in held if str(h.order) in chosen]
    for h in victims:
        h.req.preemptions += 1
        sim.counters["preempted"] += 1
    return victims


def claim_for(worker, q, held: list):
    """The next entry of stage queues `q` the worker may take, or None while its shield holds and only
    looser tiers wait (`scheduler.preemption.Shield`, as the live worker's `_claimable_tiers` and claim
    loop): expired, or with none of its tiers computing among the handles in `held`, the shield lifts."""
    while True:
        shield, max_rank = worker.shield, None
        if shield is not None:
            max_rank = shield.limit(int(worker.sim.loop.now * 1000))
            if max_rank is None:
                worker.shield = None  # expired
        item = q.claim(max_rank)
        if item is not None or max_rank is None:
            return item
        if not shield.lifts(h.req.rank for h in held):
            return None
        worker.shield = None  # lifted: claim any tier
