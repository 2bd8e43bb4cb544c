"""What calibration adds to the simulator: measured hand-offs, per-role slowdowns, engines sharing a host,
the phase decomposition of a measured run, and the fast summary of big runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyline.core.config import load_config
from skyline.tools.bench import metrics
from skyline.tools.bench.workload import WorkloadSpec
from skyline.tools.simulate import calibrate, summary
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.perf_profile import ProfileModel
from skyline.tools.simulate.request import SimRequest
from skyline.tools.simulate.roofline import roofline
from skyline.tools.simulate.systems import role_slowdowns
from skyline.tools.simulate.workload import synthetic
from tests.simmodels import HandModel

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "2026-11-30-quick" / "results.json"
PROFILE = ROOT / "skyline" / "tools" / "simulate" / "profiles" / "cpu-1core-nixl.json"


def test_the_profile_carries_a_measured_handoff_and_the_model_uses_it():
    profile = json.loads(PROFILE.read_text())
    h = profile["handoff"]
    assert h["points"] and all(p["pull_s"] > 0 for p in h["points"]) and h["neighbour_slowdown"] > 1
    m = ProfileModel.load(PROFILE)
    kv = profile["kv_transfer"]
    n = 1000
    assert m.kv_transfer_s(n) == pytest.approx(kv["latency_s"] + n * m.kv_bytes_per_token / kv["bytes_per_s"])
    # The fit stays near every measured point (within 15 ms).
    for p in h["points"]:
        assert abs(m.kv_transfer_s(p["tokens"]) - p["pull_s"]) < 0.015, p


def test_slowdown_and_handoff_overrides_scale_the_engine_not_the_transfer():
    base, slow = ProfileModel.load(PROFILE), ProfileModel.load(PROFILE, slowdown=2.0, handoff_s=0.3)
    assert slow.prefill_step_s([(0, 256)]) == pytest.approx(2 * base.prefill_step_s([(0, 256)]))
    assert slow.decode_step_s(4, 2000) == pytest.approx(2 * base.decode_step_s(4, 2000))
    assert slow.kv_transfer_s(0) == pytest.approx(0.3)
    assert slow.kv_transfer_s(500) - slow.kv_transfer_s(0) == pytest.approx(base.kv_transfer_s(500) - base.kv_transfer_s(0))
    # A colocated engine's prompt chunks and decode tokens slow down by separate factors.
    both = ProfileModel.load(PROFILE, slowdown=2.0, decode_slowdown=1.5)
    assert both.prefill_step_s([(0, 256)]) == pytest.approx(2 * base.prefill_step_s([(0, 256)]))
    assert both.decode_step_s(4, 2000) == pytest.approx(1.5 * base.decode_step_s(4, 2000))
    assert role_slowdowns("prefill=2.5,decode=1.3") == {"prefill": 2.5, "decode": 1.3}
    assert role_slowdowns("1.5") == {"prefill": 1.5, "decode": 1.5}
    assert role_slowdowns(None) == {"prefill": None, "decode": None}


def test_engines_sharing_a_host_slow_each_other_only_while_both_are_busy():
    cfg = with_overrides(load_config(None), admission=False, preemption=False)
    m = HandModel("constant", prefill_tokens_per_s=1000)  # 1 ms per prompt token, decode steps of 100 ms

    def run(factor):
        a = SimRequest(0, "chat", "interactive", 0.0, 100, 31, 1e9, 1e9)  # decodes from 0.1 s to ~3.1 s
        b = SimRequest(1, "chat", "interactive", 1.0, 500, 2, 1e9, 1e9)  # prefilled while a decodes
        Simulation(cfg, FleetSpec("disagg", 1, 1), m, m, overhead_s=0.0, neighbour_slowdown=factor).run([a, b], 60)
        return a, b

    a1, b1 = run(1.0)
    a2, b2 = run(2.0)
    assert a2.prefill_end == pytest.approx(a1.prefill_end)  # the decode engine was idle: no slowdown
    assert b2.prefill_end - b2.prefill_start == pytest.approx(2 * (b1.prefill_end - b1.prefill_start))
    # a's steps slow down while b's prompt is computed (0.5 s of prefill, 1.0 s with the neighbour busy).
    assert a2.latency_s > a1.latency_s + 0.3


def test_phases_of_the_measured_run():
    model = ProfileModel.load(PROFILE, slowdown=1.0)
    p = calibrate.phases(json.loads(MEASURED.read_text()), "skyline-disagg", model)
    assert p["requests"] == 10 and p["handoff_ms"]["n"] == 10
    assert p["handoff_ms"]["median"] == pytest.approx(391.0)  # the hand-off docs/simulator.md quotes
    assert p["prefill_ratio"]["n"] == 8 and p["prefill_ratio"]["median"] > 1.5  # the fleet ran slower than the profile
    only = calibrate.phases(json.loads(MEASURED.read_text()), "skyline-disagg", model, rate=0.15)
    assert only["requests"] == 4


def test_the_fast_summary_is_the_bench_summary():
    m = roofline("H100", "llama-3-8b")
    spec = WorkloadSpec(mix=0.8, chat_prompt=(30, 300), rag_prompt=(1000, 1600), chat_output=(8, 24),
                        rag_output=(8, 24))
    reqs = synthetic(spec, 200, 2000, lambda c: {"chat": (40, 10), "rag": (200, 12)}[c])
    sim = Simulation(load_config(None), FleetSpec("disagg", 1, 2), m, m, record_itl=True)
    duration = sim.run(reqs, 1.0)
    assert {r.outcome for r in reqs} >= {"ok", "rejected"}
    slow, fast = metrics.summarize(reqs, duration), summary.summarize(reqs, duration)
    assert fast.keys() == slow.keys()
    for key, value in slow.items():
        if isinstance(value, dict) and "p50" in value:
            assert fast[key] == pytest.approx(value, rel=1e-9), key
        elif key == "prefix_cache":  # the oracle's hit rate: NaN in both
            assert fast[key] == pytest.approx(value, nan_ok=True), key
        else:
            assert fast[key] == value, key


MULTITURN = ROOT / "benchmarks" / "2026-12-02-multiturn" / "results.json"
PROFILE_1CORE = ROOT / "skyline" / "tools" / "simulate" / "profiles" / "cpu-1core-nixl-2026-12-01-1727.json"


def _replay_multiturn(system: str, prefill_factor: float | None = None) -> dict[float, dict]:
    """The measured multi-turn run of `system` replayed on two colocated 1-core engines with prefix caches
    (its sessions' prefixes regenerated), affinity as the system had it; summary per rate."""
    from dataclasses import replace

    from skyline.tools.simulate.workload import load_trace

    model = ProfileModel.load(PROFILE_1CORE, slowdown=prefill_factor, decode_slowdown=1.0 if prefill_factor else None)
    cfg = load_config(None)
    cfg = replace(cfg, gateway=replace(cfg.gateway, prefix_affinity=system == "skyline-affinity"))
    trace, _meta = load_trace(MULTITURN, system, block_size=model.block_size)
    out = {}
    for rate, reqs in sorted(trace.items()):
        reqs = [r.resent() for r in reqs]
        duration = Simulation(cfg, FleetSpec("colocated", 0, 2), model, model, prefix_cache=True).run(reqs, 120.0)
        out[rate] = metrics.summarize(reqs, duration)
    return out


@pytest.mark.parametrize("system", ["skyline-affinity", "skyline-no-affinity"])
def test_the_multiturn_run_replayed_hits_the_prefix_cache_as_measured(system):
    """docs/simulator.md "Prefix caches and affinity": the simulated hit rate within 5 points of the
    measured one at both rates (nothing fitted), the gap affinity makes within 5 points of the measured
    gap, and, with the prefill steps slowed as the run's own engine steps measured, TTFT p50 within 25%."""
    doc = json.loads(MULTITURN.read_text())
    measured = {r["rate"]: r["summary"] for r in doc["runs"] if r["system"] == system}
    other = "skyline-no-affinity" if system == "skyline-affinity" else "skyline-affinity"
    measured_other = {r["rate"]: r["summary"] for r in doc["runs"] if r["system"] == other}
    sim, sim_other = _replay_multiturn(system), _replay_multiturn(other)
    for rate, m in measured.items():
        hit, want = sim[rate]["prefix_cache"]["hit_rate"], m["prefix_cache"]["hit_rate"]
        assert abs(hit - want) <= 0.05, (rate, hit, want)
        gap = hit - sim_other[rate]["prefix_cache"]["hit_rate"]
        want_gap = want - measured_other[rate]["prefix_cache"]["hit_rate"]
        assert abs(gap - want_gap) <= 0.05, (rate, gap, want_gap)
    factor = calibrate.prefill_step_factor(doc["systems"][system]["engine_steps"], ProfileModel.load(PROFILE_1CORE))
    assert 1.1 < factor < 1.4  # the fleet's prefill steps ran slower than the engine alone
    for rate, s in _replay_multiturn(system, factor).items():
        ttft, want = s["ttft_ms"]["p50"], measured[rate]["ttft_ms"]["p50"]
        assert abs(ttft - want) <= 0.25 * want, (rate, ttft, want)
