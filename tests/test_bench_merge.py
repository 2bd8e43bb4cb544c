"""`skyline bench merge` on hand-made results (pure): what merges, what is refused and why."""

from __future__ import annotations

import copy

import pytest

from skyline.tools.bench.merge import MergeError, merge, select


def part(rates, systems=("vllm-fcfs", "skyline-colocated"), ttft=574.3, attain=1.0):
    runs, records = [], []
    for s in systems:
        for r in rates:
            runs.append({"system": s, "rate": r, "summary": {"attainment": attain, "output_throughput": 10.0,
                                                             "by_tier": {}}})
            records.append({"system": s, "rate": r, "tier": "interactive", "outcome": "ok", "ttft_s": 0.1})
    return {
        "command": f"skyline bench run --rates {','.join(map(str, rates))}", "complete": True, "finished": "t",
        "machine": {"cpus": 2, "platform": "x", "loadavg_start": "1", "loadavg_end": "2"},
        "config": {"systems": list(systems), "rates": list(rates), "duration_s": 120.0, "num_requests": None,
                   "workload": {"mix": 0.8, "seed": 0, "chat_tier": "interactive"}},
        "slo": {"ttft_ms": {"chat": ttft}, "tpot_ms": {"chat": 199.0}, "source": "derived"},
        "systems": {s: {"status": "ok", "wall_s": 10.0} for s in systems},
        "goodput": {}, "runs": runs, "probe": [], "records": records,
    }


def test_an_extended_sweep_is_one_run_with_goodput_over_every_rate():
    low, high = part([0.1, 0.5]), part([1.0, 2.0], ttft=574.0, attain=0.5)  # targets given back rounded: same
    m = merge([low, high])
    assert m["config"]["rates"] == [0.1, 0.5, 1.0, 2.0]
    assert [(r["system"], r["rate"]) for r in m["runs"]][:4] == [("vllm-fcfs", 0.1), ("vllm-fcfs", 0.5),
                                                                  ("vllm-fcfs", 1.0), ("vllm-fcfs", 2.0)]
    assert len(m["records"]) == len(low["records"]) + len(high["records"])
    # 100% at 0.5, 50% at 1.0: crosses 90% at 0.5 + 0.1/0.5 * 0.5 = 0.6
    assert m["goodput"]["vllm-fcfs"]["rps"] == pytest.approx(0.6)
    assert m["systems"]["vllm-fcfs"]["wall_s"] == 20.0
    assert m["slo"] == low["slo"] and "&&" in m["command"]


def test_runs_that_measured_different_things_are_refused():
    base = part([0.1])
    with pytest.raises(MergeError, match="SLO targets"):
        merge([base, part([1.0], ttft=600)])
    other = part([1.0])
    other["config"]["workload"]["mix"] = 0.5
    with pytest.raises(MergeError, match="workload"):
        merge([base, other])
    with pytest.raises(MergeError, match="more than one run"):
        merge([base, copy.deepcopy(base)])


def test_a_failed_system_in_any_part_stays_failed():
    low, high = part([0.1]), part([1.0])
    high["systems"]["skyline-colocated"] = {"status": "failed", "error": "boom", "wall_s": 1.0}
    assert merge([low, high])["systems"]["skyline-colocated"]["status"] == "failed"


def test_a_system_measured_again_replaces_the_first_measurement_when_selected():
    first, again = part([0.1, 0.5]), part([0.1, 0.5], systems=("skyline-colocated",), attain=0.5)
    m = merge([select(first, ["vllm-fcfs"]), again])
    assert m["config"]["systems"] == ["vllm-fcfs", "skyline-colocated"]
    assert {r["summary"]["attainment"] for r in m["runs"] if r["system"] == "skyline-colocated"} == {0.5}
    with pytest.raises(MergeError, match="no system vllm-x"):
        select(first, ["vllm-x"])
