"""The simulator's claim order by latest start (scheduler/edf.py `start_by_ms`) and the pace rule's bound
(scheduler/decode_room.py `paced_claim_due`), the rules the live worker keeps (tests/test_streams.py,
tests/test_elastic_workers.py). One elastic engine on a hand-checkable model: prompts at 1,000 tokens/s
(the prior rate, and what the engine's meter measures), decode steps of 10 ms; the default tiers
(interactive 1 s, standard 5 s, batch 60 s to the first token)."""

from __future__ import annotations

from skyline.core.config import load_config
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.request import SimRequest
from tests.simmodels import HandModel

CFG = with_overrides(load_config(None), admission=False, min_remote_prefill_tokens=1_000_000)
MODEL = HandModel("e", 1_000.0, step_s=0.01)
INF = float("inf")


def _claim_order(reqs: list[SimRequest], cfg=CFG) -> list[tuple[int, float]]:
    """(request index, when) of every claim of a one-engine elastic fleet, in claim order."""
    sim = Simulation(cfg, FleetSpec("elastic", 0, 1), MODEL, MODEL)
    order: list[tuple[int, float]] = []
    w = sim.decode_workers[0]

    def take(item, q, now, inner=w.take):
        order.append((item[0].index, round(now, 3)))
        inner(item, q, now)

    w.take = take  # type: ignore[method-assign]
    sim.run(reqs, 60.0)
    assert all(r.outcome == "ok" for r in reqs), [(r.index, r.outcome) for r in reqs]
    return order


def test_a_long_prompt_that_must_start_first_is_claimed_before_a_chat_due_earlier():
    # The engine computes a 3,000-token prompt until 3 s (its prompt budget full: nothing else is claimed).
    # A 2,000-token standard prompt sent at 0.1 s is due at 5.1 s and must start by 3.1 s; a 100-token
    # interactive one sent at 2.5 s is due at 3.5 s and must start by 3.4 s. By deadline the chat would go
    # first, and the long prompt would start at 3.1 s at the earliest and miss.
    reqs = [SimRequest(0, "chat", "interactive", 0.0, 3_000, 2, INF, INF),
            SimRequest(1, "rag", "standard", 0.1, 2_000, 2, INF, INF),
            SimRequest(2, "chat", "interactive", 2.5, 100, 2, INF, INF)]
    order = _claim_order(reqs)
    assert [i for i, _at in order] == [0, 1, 2]
    assert dict(order)[1] <= 3.1  # by its latest start


def test_a_paced_out_engine_claims_only_what_must_start_now():
    # Two streams with a 1 ms TPOT target decode ~2 s of 10 ms steps; two more end at 0.6 s and 0.8 s (batch
    # events: the pace is read at the first, the engine is paced out from then). Sent at 0.65 s: one due
    # 50 ms later (its 10 tokens take 10 ms: it must start by 0.69 s), one due 400 ms later (by 1.04 s), each
    # claimed then, and a batch one, due in a minute, claimed when a stream ends.
    reqs = [SimRequest(0, "chat", "interactive", 0.0, 10, 200, INF, 1.0),
            SimRequest(1, "chat", "interactive", 0.0, 10, 200, INF, 1.0),
            SimRequest(4, "chat", "interactive", 0.0, 10, 60, INF, 1.0),
            SimRequest(5, "chat", "interactive", 0.0, 10, 80, INF, 1.0),
            SimRequest(2, "chat", "interactive", 0.65, 10, 2, 50.0, INF),
            SimRequest(6, "chat", "interactive", 0.65, 10, 2, 400.0, INF),
            SimRequest(3, "chat", "batch", 0.65, 10, 2, INF, INF)]
    claims = dict(_claim_order(reqs))
    streams_end = min(reqs[0].done_t, reqs[1].done_t)
    assert abs(claims[2] - 0.69) <= 0.002, claims
    assert abs(claims[6] - 1.04) <= 0.002, claims
    assert claims[3] >= streams_end - 0.02, (claims, streams_end)


def test_with_the_pace_rule_off_the_engine_claims_everything_at_once():
    reqs = [SimRequest(0, "chat", "interactive", 0.0, 10, 200, INF, 1.0),
            SimRequest(1, "chat", "interactive", 0.0, 10, 200, INF, 1.0),
            SimRequest(4, "chat", "interactive", 0.0, 10, 60, INF, 1.0),
            SimRequest(5, "chat", "interactive", 0.0, 10, 80, INF, 1.0),
            SimRequest(3, "chat", "batch", 0.65, 10, 2, INF, INF)]
    claims = dict(_claim_order(reqs, with_overrides(CFG, tpot_headroom=0.0)))
    assert claims[3] == 0.65, claims
