"""`skyline simulate --search` on workloads whose answer is known by hand, and the admission
semantics the search depends on (colocated prompts leave the backlog at their first token; decode
workers heartbeat the prefill rate they measure)."""

from __future__ import annotations

import pytest

from skyline.core.config import load_config
from skyline.tools.bench import metrics
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.request import SimRequest
from skyline.tools.simulate.roofline import roofline
from skyline.tools.simulate.search import lower_bounds, search_colocated, search_disagg
from skyline.tools.simulate.systems import SimSystem
from tests.simmodels import HandModel

# Prefill 400 tokens/s in 100-token steps; every decode step 100 ms whatever the batch; no transfer.
# The hand calculations assume workers claim up to max_running (no decode pace rule: tpot_headroom=0).
FIXED_RATE = HandModel("fixed-rate", prefill_tokens_per_s=400, max_step_tokens=100)


def _even_arrivals(n=300, gap=0.1):
    """10 req/s exactly: 100-token prompts (0.25 s of prefill each), 10 output tokens (10 decode steps)."""
    return lambda: [SimRequest(i, "chat", "interactive", i * gap, 100, 10, 1000.0, 150.0) for i in range(n)]


def test_search_finds_the_split_a_hand_calculation_gives():
    """A prefill worker serves 4 req/s (0.25 s each); a decode worker holding 4 sequences for 10 steps of
    0.1 s serves 4 req/s. At 10 req/s a fleet needs 3 of each: every 5-GPU split leaves one pool short
    (its queue grows by 2 req/s, so TTFT passes 1 s within seconds), and 2P+4D / 4P+2D fail the same way."""
    cfg = with_overrides(load_config(None), admission=False, preemption=False, max_running=4, min_remote_prefill_tokens=0,
                         tpot_headroom=0.0)
    m = FIXED_RATE
    system = SimSystem("sim-disagg", FleetSpec("disagg", 1, 1), m, m)
    tried: list = []
    split = search_disagg(cfg, system, _even_arrivals(), 5.0, 8, (1, 1), tried)
    assert split == (3, 3)
    assert [t["fleet"] for t in tried if t["attainment"] >= 0.9] == ["3P+3D"]
    assert max(t["devices"] for t in tried) == 6  # stops at the first device count that serves the rate
    assert lower_bounds(cfg, system, 10.0, 100, 10) == (3, 3)  # the throughput bound agrees


def test_colocated_search_returns_the_smallest_fleet_that_meets_the_goal():
    cfg = with_overrides(load_config(None), admission=False, preemption=False, max_running=4, min_remote_prefill_tokens=0,
                         tpot_headroom=0.0)
    m = FIXED_RATE
    system = SimSystem("sim-colocated", FleetSpec("colocated", 0, 1), m, m)
    reqs_of = _even_arrivals(200)
    tried: list = []
    found = search_colocated(cfg, system, reqs_of, 5.0, 16, tried)
    brute = []
    for n in range(1, 9):
        reqs = reqs_of()
        sim = Simulation(cfg, FleetSpec("colocated", 0, n), m, m)
        brute.append(metrics.summarize(reqs, sim.run(reqs, 5.0))["attainment"])
    assert found == 1 + next(i for i, a in enumerate(brute) if a >= 0.9)
    assert all(a < 0.9 for a in brute[: found - 1]) and found > 1


def test_a_colocated_prompt_leaves_the_backlog_at_its_first_token_and_is_metered():
    """Live (workers/decode.py): the decode worker meters the prompts it prefills and releases
    them from the backlog at the first token, not when the answer ends."""
    cfg = with_overrides(load_config(None), admission=True)
    m = FIXED_RATE
    sim = Simulation(cfg, FleetSpec("colocated", 0, 1), m, m)
    req = SimRequest(0, "chat", "interactive", 0.0, 100, 50, 1e9, 1e9)  # ~5 s of decoding after 0.25 s
    seen = {}
    sim.loop.at(1.0, lambda _: seen.update(backlog=dict(sim.decode_q.backlog)))
    sim.loop.at(2.5, lambda _: seen.update(rate=sim.seen_rate["decode"]))  # after the heartbeat at 2 s
    sim.run([req], drain_s=60)
    assert req.outcome == "ok" and req.done_t > 5.0
    assert seen["backlog"] == {t: 0 for t in seen["backlog"]}
    assert seen["rate"] == pytest.approx(100 / 0.25)  # 100 tokens from claim to first token (one step)


def test_admission_does_not_shed_a_colocated_gpu_fleet_that_keeps_up():
    """Before decode workers reported a rate, the gateway predicted colocated TTFTs at the 1,000
    tokens/s prior and counted every running answer as backlog: ~10% attainment at any size."""
    m = roofline("H100", "llama-3-8b")
    cfg = load_config(None)  # admission on
    reqs = [SimRequest(i, "chat" if i % 5 else "rag", "interactive" if i % 5 else "standard", i * 0.02,
                       150 if i % 5 else 1300, 16, 500 if i % 5 else 2000, 50) for i in range(1500)]
    sim = Simulation(cfg, FleetSpec("colocated", 0, 4), m, m)
    s = metrics.summarize(reqs, sim.run(reqs, 30))
    assert s["attainment"] >= 0.95, sim.counters
    assert sim.seen_rate["decode"] and sim.seen_rate["decode"] > 10_000
