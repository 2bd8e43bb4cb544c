"""Who claims a prompt first in the simulator: the live claim defer (scheduler/claiming.py "Who claims first").

A worker whose engine computes prompts waits before it claims one more only while a peer, as the last
heartbeat said (every simulated second), would be free of its own prompts sooner: for the difference of
their times to free, at most `[worker] claim_defer_max_s`, its own counted in the tokens it has left
(estimated from its claims' times at its measured rate); it claims as soon as one of its prompts is done.
Elastic engines on a hand-checkable model: prompts at 1,000 tokens/s (the prior rate the claim defer uses
until a rate is measured), every prompt served whole where it is claimed (the colocated route).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from skyline.core.config import load_config
from skyline.scheduler.claiming import IDLE_PEER_ANSWER_S
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.request import SimRequest
from tests.simmodels import HandModel

CFG = with_overrides(load_config(None), admission=False, min_remote_prefill_tokens=1_000_000)
RATE = CFG.worker.prior_prefill_tokens_per_s  # 1,000 tokens/s: the model's speed and the rate the defer uses
MODEL = HandModel("e", RATE, step_s=0.01)


def _request(i: int, at: float, prompt: int, tier: str = "standard") -> SimRequest:
    return SimRequest(i, "chat", tier, at, prompt, 4, float("inf"), float("inf"))


def _claims(reqs: list[SimRequest], engines: int = 2, cfg=CFG, model=MODEL) -> dict[int, tuple[str, float]]:
    """request index -> (the elastic worker that claimed it, when)."""
    sim = Simulation(cfg, FleetSpec("elastic", 0, engines), model, model)
    claims: dict[int, tuple[str, float]] = {}
    for w in sim.decode_workers:
        def take(item, q, now, w=w, inner=w.take):
            claims.setdefault(item[0].index, (w.name, now))
            inner(item, q, now)
        w.take = take  # type: ignore[method-assign]
    sim.run(reqs, 30.0)
    assert all(r.outcome == "ok" for r in reqs)
    assert sim.prefill_q.deferring == sim.decode_q.deferring == 0 and not any(w.asleep for w in sim.decode_workers)
    return claims


# elastic-0 computes a 2,000-token prompt (2 s); elastic-1 claims a 100-token one (0.1 s), after which
# the ready queue holds elastic-0 first: without the defer, the next prompt would go to it. The
# heartbeats of 0 s show both engines free.
BUSY_FIRST = [_request(0, 0.0, 2_000), _request(1, 0.001, 100)]


def test_an_idle_engine_claims_a_new_prompt_before_the_one_computing():
    claims = _claims([*BUSY_FIRST, _request(2, 0.5, 300)])
    assert claims[0][0] == "elastic-0" and claims[1][0] == "elastic-1"
    assert claims[2] == ("elastic-1", 0.5)  # computing nothing by then: at once


def test_when_both_compute_the_one_with_less_left_claims_when_it_is_done():
    claims = _claims([*BUSY_FIRST, _request(2, 0.01, 300)])
    # elastic-0 would wait 0.25 s (1.99 s left, capped), elastic-1 its 91 tokens left: it claims then, at the
    # end of its prompt (the tokens left, not the whole prompt's 0.1 s).
    name, at = claims[2]
    assert name == "elastic-1" and at == pytest.approx(0.001 + 100 / RATE)


def test_a_worker_no_peer_would_beat_claims_at_once():
    """Past the heartbeat of 1 s, which saw elastic-0 computing 1,900 tokens and elastic-1 1,000: a prompt
    at 1.05 s goes to elastic-1 at once (0.9 s left against its peer's 1.9 s), though elastic-0 waited
    longer for work and both compute."""
    claims = _claims([_request(0, 0.9, 1_900), _request(1, 0.95, 1_000), _request(2, 1.05, 300)])
    assert claims[0][0] == "elastic-0" and claims[1][0] == "elastic-1"
    assert claims[2] == ("elastic-1", 1.05)


def test_with_the_defer_off_the_longest_waiting_worker_claims_at_once():
    off = replace(CFG, worker=replace(CFG.worker, claim_defer_max_s=0.0))
    claims = _claims([*BUSY_FIRST, _request(2, 0.01, 300)], cfg=off)
    assert claims[2] == ("elastic-0", 0.01)  # the case above, as the simulator had it before the defer


def test_a_stricter_tier_goes_to_the_engine_computing_no_prompt():
    """elastic-0 computes a 2,000-token prompt, elastic-1 nothing: a chat of the interactive tier is left to
    elastic-1, which takes it at once, instead of holding elastic-0's prompt for its steps."""
    claims = _claims([_request(0, 0.0, 2_000), _request(1, 0.5, 300, tier="interactive")])
    assert claims[0][0] == "elastic-0"
    assert claims[1] == ("elastic-1", 0.5)


def test_a_stricter_tier_is_claimed_at_once_where_every_engine_computes():
    """Past the heartbeat of 1 s, which saw both engines computing: the chat is claimed at its arrival (it
    would preempt), not left to a peer that is not idle."""
    claims = _claims([_request(0, 0.9, 1_900), _request(1, 0.95, 1_000), _request(2, 1.05, 300, tier="interactive")])
    assert claims[2][1] == 1.05


def test_a_stricter_tier_waits_for_an_idle_peer_no_longer_than_an_idle_peer_takes_to_answer():
    """The heartbeats of 0 s show both engines free, but both compute by 0.01 s: each leaves the chat to the
    other for at most `IDLE_PEER_ANSWER_S`, and elastic-1, whose 100-token prompt is done at 0.101 s, claims
    it then (a worker stops waiting when one of its prompts is done)."""
    claims = _claims([*BUSY_FIRST, _request(2, 0.01, 300, tier="interactive")])
    assert claims[2] == ("elastic-1", pytest.approx(0.001 + 100 / RATE))
    assert claims[2][1] - 0.01 <= IDLE_PEER_ANSWER_S


def test_a_worker_without_peers_never_waits():
    """One engine, full (a prompt over the 2,048-token budget) while two prompts queue: when its prompt is
    done it claims the first, and the second right after, though it computes the first: no engine would
    take it sooner."""
    long, a, b = _request(0, 0.0, 2_100), _request(1, 0.01, 200), _request(2, 0.02, 300)
    claims = _claims([long, a, b], engines=1)
    done = 2_100 / RATE
    assert claims[1][1] == pytest.approx(done) and claims[2][1] == pytest.approx(done)


def test_a_waiting_worker_claims_as_soon_as_its_prompt_is_done():
    """Engines twice as fast as the prior rate the defer estimates with: each would wait its capped 0.25 s
    at 0.3 s, but elastic-0's prompt is done at 0.5 s, and it claims then, not at 0.55 s."""
    fast = HandModel("e", 2 * RATE, step_s=0.01)
    reqs = [_request(0, 0.0, 1_000), _request(1, 0.001, 1_000), _request(2, 0.3, 300)]
    claims = _claims(reqs, model=fast)
    assert claims[2] == ("elastic-0", pytest.approx(0.5))


def test_a_simulated_elastic_worker_leaves_a_long_prompt_to_a_peer_decoding_fewer_streams():
    """`preempt.claim_defer` for a worker computing nothing: an elastic one decoding streams waits for the idle
    peer that decodes fewer (`claiming.long_prompt_defer_s`) on the prefill stage's prompts only, as the live
    `WorkerRuntime._claim_defer`; `may_defer` lets it ask."""
    from types import SimpleNamespace

    from skyline.scheduler.claiming import FreestPeers
    from skyline.tools.simulate.preempt import claim_defer

    sim = Simulation(CFG, FleetSpec("elastic", 0, 2), MODEL, MODEL)
    sim.freest = FreestPeers(idle_by_stage={"prefill": ((0, "elastic-1"), (2, "elastic-0")),
                                            "decode": ((0, "elastic-1"), (2, "elastic-0"))})
    me = sim.decode_workers[0]
    me.streams = lambda: 2  # type: ignore[method-assign]
    long = (_request(0, 0.0, 1_500), None)
    assert me.may_defer()
    assert claim_defer(me, sim.prefill_q, long, []) == pytest.approx(IDLE_PEER_ANSWER_S)
    assert claim_defer(me, sim.decode_q, long, []) == 0.0  # a short prompt's stage: where it finishes first
    assert claim_defer(me, sim.prefill_q, (long[0], SimpleNamespace()), []) == 0.0  # a KV hand-off
    me.streams = lambda: 0  # type: ignore[method-assign]
    assert not me.may_defer() and claim_defer(me, sim.prefill_q, long, []) == 0.0
