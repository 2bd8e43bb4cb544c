"""`skyline bench run` metric code on hand-made records with known answers (pure; no servers)."""

from __future__ import annotations

import math
import random

import pytest

from skyline.tools.bench.client import RequestRecord

from skyline.core.stats import percentile
from skyline.tools.bench.metrics import format_goodput, goodput, summarize
from skyline.tools.bench.record import BenchRecord, build_record
from skyline.tools.bench.shaping import shape
from skyline.tools.bench.slo import SloTargets, derive_targets, fleet_tiers
from skyline.tools.bench.verdict import tpot
from skyline.tools.bench.workload import BenchRequest, WorkloadSpec, arrival_offsets, class_sequence, make_requests


def rec(outcome="ok", ttft=0.1, latency=1.0, out=10, cls="chat", tier="interactive", targets=(200.0, 100.0),
        itl=(), prompt=50) -> BenchRecord:
    """A finished request as build_record would make it, with TPOT and attainment computed the real way."""
    r = BenchRecord("sys", 1.0, 0, cls, tier, prompt, out, 0.0, outcome=outcome,
                    ttft_target_ms=targets[0], tpot_target_ms=targets[1])
    if outcome == "ok":
        r.server_prompt_tokens, r.output_tokens, r.ttft_s, r.latency_s = prompt, out, ttft, latency
        r.tpot_s = tpot(latency, ttft, out)
        r.itl_s = list(itl)
        r.attained = r.ttft_s * 1000 <= targets[0] and r.tpot_s * 1000 <= targets[1]
    return r


# -- definitions ------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_like_numpy():
    xs = [10.0, 20.0, 30.0, 40.0]
    assert percentile(xs, 50) == 25.0
    assert percentile(xs, 90) == pytest.approx(37.0)  # pos 2.7 -> 30 + 0.7 * 10
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_tpot_is_vllm_definition():
    assert tpot(latency_s=2.1, ttft_s=0.1, output_tokens=11) == pytest.approx(0.2)  # 2.0 s over 10 gaps
    assert tpot(1.0, 0.5, 1) == 0.0  # one token: no decode steps


def test_build_record_derives_tpot_itl_and_attainment():
    req = BenchRequest(3, "chat", "interactive", 0.5, "hi", 40, 5)
    raw = RequestRecord(ok=True, status=200, ttft_s=0.2, latency_s=1.0, output_tokens=5, prompt_tokens=41,
                        chunk_times=[0.2, 0.4, 0.6, 0.8, 1.0])
    r = build_record("s", 2.0, req, 0.51, raw, (250.0, 200.0))
    assert (r.outcome, r.index, r.tier, r.server_prompt_tokens) == ("ok", 3, "interactive", 41)
    assert r.tpot_s == pytest.approx(0.2)
    assert r.itl_s == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert r.attained  # TTFT 200 <= 250, TPOT 200 <= 200 (the bound is inclusive)
    assert not build_record("s", 2.0, req, 0.5, raw, (199.0, 200.0)).attained  # TTFT misses
    assert not build_record("s", 2.0, req, 0.5, raw, (250.0, 199.0)).attained  # TPOT misses


def test_build_record_outcomes():
    req = BenchRequest(0, "rag", "standard", 0.0, "x", 1500, 8)
    rejected = build_record("s", 1.0, req, 0.0, RequestRecord(status=429, error="shed"), (1e9, 1e9))
    failed = build_record("s", 1.0, req, 0.0, RequestRecord(status=500, error="boom"), (1e9, 1e9))
    cancelled = build_record("s", 1.0, req, 0.0, None, (1e9, 1e9))
    empty = build_record("s", 1.0, req, 0.0, RequestRecord(ok=True, status=200, output_tokens=0), (1e9, 1e9))
    assert [r.outcome for r in (rejected, failed, cancelled, empty)] == ["rejected", "error", "cancelled", "error"]
    assert not any(r.attained for r in (rejected, failed, cancelled, empty))  # even with infinite targets


# -- summaries --------------------------------------------------------------------------------


def test_summary_counts_attainment_and_throughput():
    records = [
        rec(ttft=0.1, latency=1.0, out=10, itl=[0.1, 0.1]),                 # attains: TPOT 100 ms
        rec(ttft=0.3, latency=1.2, out=10),                                  # misses TTFT (300 > 200)
        # RAG: TTFT fine, TPOT 200 > 150 misses
        rec(ttft=0.1, latency=2.1, out=11, cls="rag", tier="standard", targets=(2000.0, 150.0), prompt=1000),
        rec(outcome="rejected", cls="rag", tier="standard"),
        rec(outcome="error"),
        rec(outcome="cancelled"),
    ]
    s = summarize(records, duration_s=4.0)
    assert (s["sent"], s["ok"], s["rejected"], s["error"], s["cancelled"]) == (6, 3, 1, 1, 1)
    assert s["ok"] + s["rejected"] + s["error"] + s["cancelled"] == s["sent"]
    assert s["attained"] == 1 and s["attainment"] == pytest.approx(1 / 6)  # failures count as missed
    assert s["attainment_ttft"] == pytest.approx(2 / 6) and s["attainment_tpot"] == pytest.approx(2 / 6)
    assert s["by_tier"]["interactive"] == {"sent": 4, "attained": 1, "attainment": 0.25}
    assert s["by_tier"]["standard"] == {"sent": 2, "attained": 0, "attainment": 0.0}
    assert s["by_class"]["rag"]["sent"] == 2
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["output_throughput"] == pytest.approx(31 / 4.0)
    assert s["total_token_throughput"] == pytest.approx((31 + 50 + 50 + 1000) / 4.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # TPOTs 100, 100, 200
    assert s["e2e_ms"]["p99"] == pytest.approx(1200 + 0.98 * 900)  # sorted 1000, 1200, 2100; pos 1.98
    assert s["itl_ms"]["mean"] == pytest.approx(100.0)


def test_summary_of_only_failures_has_no_latencies():
    s = summarize([rec(outcome="rejected"), rec(outcome="error")], duration_s=1.0)
    assert s["attainment"] == 0.0 and s["request_throughput"] == 0.0
    assert math.isnan(s["ttft_ms"]["p50"])


# -- goodput ----------------------------------------------------------------------------------


def test_goodput_interpolates_the_first_crossing():
    g = goodput([(1.0, 1.0), (2.0, 0.95), (3.0, 0.75), (4.0, 0.95)])
    # crossing between 2 (95%) and 3 (75%): 2 + (0.95 - 0.9) / 0.2 = 2.25; the recovery at 4 is noise
    assert g["bound"] == "interpolated" and g["rps"] == pytest.approx(2.25)
    assert format_goodput(g) == "2.25"


def test_goodput_bounds():
    assert goodput([(0.5, 0.9), (1.0, 0.99)]) == {"rps": 1.0, "bound": "at_least", "goal": 0.9}
    below = goodput([(1.0, 0.5), (2.0, 0.2)])
    assert below["rps"] is None and format_goodput(below) == "< 1.00"
    assert goodput([(2.0, 0.5), (1.0, 0.9)])["rps"] == pytest.approx(1.0)  # unsorted input; exactly 90% counts
    assert goodput([])["bound"] == "no_data"


def test_slo_targets_are_a_multiple_of_unloaded_medians():
    probe = [rec(ttft=0.1, latency=1.0, out=10), rec(ttft=0.3, latency=2.2, out=20),
             rec(ttft=2.0, latency=4.0, out=11, cls="rag"), rec(outcome="error", cls="rag")]
    t = derive_targets(probe, scale=5, baseline="vllm-fcfs", explicit_tpot={"rag": 999.0})
    assert t.unloaded["chat"] == {"ttft_ms": pytest.approx(200.0), "tpot_ms": pytest.approx(100.0)}
    assert t.ttft_ms == {"chat": 1000, "rag": 10000}
    assert t.tpot_ms == {"chat": 500, "rag": 999.0}  # explicit wins
    assert "5x" in t.source and "vllm-fcfs" in t.source


def test_a_fleet_under_test_has_its_tiers_set_to_the_targets_it_is_judged_against(tmp_path):
    from skyline.core.config import load_config
    from skyline.scheduler.tiers import Tier
    from skyline.tools.bench.config_file import with_changes

    targets = SloTargets({"chat": 2917.4, "rag": 52874}, {"chat": 483, "rag": 549}, "derived")
    tiers = fleet_tiers(load_config(None).tiers, targets, WorkloadSpec().tier_of)
    # Looser than the defaults (1,000 / 5,000 ms) and the tiers' other settings kept.
    assert tiers["interactive"] == {"ttft_ms": 2917, "tpot_ms": 483, "priority": 0, "drop_late_ms": 9000}
    assert tiers["standard"] == {"ttft_ms": 52874, "tpot_ms": 549, "priority": 1, "drop_late_ms": 55000}
    assert tiers["batch"] == {"ttft_ms": 60000, "tpot_ms": 2000, "priority": 2, "drop_late_ms": -1}
    written = load_config(with_changes("", {"tiers": tiers}, tmp_path / "skyline.toml"))  # as the fleet reads it
    assert [(t.name, t.ttft_ms) for t in written.tiers] == [("interactive", 2917), ("standard", 52874),
                                                            ("batch", 60000)]
    # Two classes in one tier: the stricter targets of the two.
    both = fleet_tiers((Tier("standard", 5000, 500, 1),), targets, lambda cls: "standard")
    assert both["standard"]["ttft_ms"] == 2917 and both["standard"]["tpot_ms"] == 483


# -- workload and request shaping -------------------------------------------------------------


def test_arrivals_have_the_requested_mean_rate():
    for arrival, burst in (("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)):
        t = arrival_offsets(4000, 2.0, random.Random(1), arrival, burst)
        assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
        assert (len(t) - 1) / t[-1] == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, random.Random(1))


def test_class_sequence_keeps_the_mix_in_every_prefix():
    seq = class_sequence(100, 0.8, 0.37)
    for n in range(1, 101):
        assert abs(seq[:n].count("rag") - 0.2 * n) <= 1
    assert set(class_sequence(10, 1.0, 0.5)) == {"chat"}


class FakeBuilder:
    def chat(self, target, rng):
        return f"chat {rng.random()}", target

    def rag(self, target, rng):
        return f"rag {rng.random()}", target


def test_workload_is_deterministic_and_fresh_per_rate():
    spec = WorkloadSpec(mix=0.5, seed=7, chat_prompt=(30, 40), rag_prompt=(1000, 1100))
    a = make_requests(spec, FakeBuilder(), 20, rate=1.0)
    assert a == make_requests(spec, FakeBuilder(), 20, rate=1.0)  # same seed, same requests at the same times
    b = make_requests(spec, FakeBuilder(), 20, rate=2.0)
    # another rate, other prompts: a prefix cache must not make the next rate's prefills free
    assert not {r.content for r in a} & {r.content for r in b}
    assert {r.tier for r in a if r.cls == "rag"} == {"standard"}
    assert {r.tier for r in a if r.cls == "chat"} == {"interactive"}
    assert all(1000 <= r.prompt_tokens <= 1100 for r in a if r.cls == "rag")


def test_shaping_per_flavor():
    req = BenchRequest(0, "rag", "standard", 0.0, "hello", 1500, 16)
    body, headers = shape("plain", req, "m", (5000.0, 300.0))
    assert headers == {} and "priority" not in body and body["max_tokens"] == 16 and body["ignore_eos"] is True
    body, _ = shape("priority", req, "m", (5000.0, 300.0))
    assert body["priority"] == 1
    _, headers = shape("skyline", req, "m", (5000.0, 300.4))
    assert headers == {"x-slo-tier": "standard", "x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "300"}
    _, headers = shape("skyline", req, "m", (math.inf, math.inf))
    assert headers == {"x-slo-tier": "standard"}  # targets unknown yet: tier defaults
    _, headers = shape("skyline", req, "m", (5000.0, 300.0), allow_demotion=True)
    assert headers["x-slo-allow-demotion"] == "true"


def test_prompt_builder_hits_the_target_length():
    from skyline.tools.bench.corpus import QUESTIONS
    from skyline.tools.bench.prompts import PromptBuilder
    from skyline.tools.bench.tokenizer import SimTokenizer

    b = PromptBuilder(SimTokenizer())
    rng = random.Random(0)
    for target in (120, 900, 1800):
        content, n = b.rag(target, rng)
        assert target - 5 <= n <= target and b.count(content) == n and "Question:" in content
    content, n = b.chat(200, rng)
    assert 195 <= n <= 200 and any(content.endswith(q) for q in QUESTIONS)  # the question survives the cut
