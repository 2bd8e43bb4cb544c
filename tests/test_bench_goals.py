"""The benchmark issue's goal ratios, on hand-made results with known answers (pure)."""

from __future__ import annotations

import pytest

from skyline.tools.bench.goals import goals, tier_ttft_p99_ms
from skyline.tools.bench.metrics import goodput

RATES = (0.5, 1.0, 2.0)


def results(table: dict[str, list[tuple[float, float, float, float]]]) -> dict:
    """table: system -> per rate (attainment, interactive attainment, output tok/s, interactive TTFT s).

    Each rate gets ten completed interactive records, all with the given TTFT.
    """
    runs, records, gp = [], [], {}
    for system, rows in table.items():
        for rate, (att, inter, tok_s, ttft) in zip(RATES, rows):
            runs.append({"system": system, "rate": rate, "summary": {
                "attainment": att, "output_throughput": tok_s, "by_tier": {"interactive": {"attainment": inter}}}})
            records += [{"system": system, "rate": rate, "tier": "interactive", "outcome": "ok", "ttft_s": ttft}] * 10
        gp[system] = goodput([(r, row[0]) for r, row in zip(RATES, rows)])
    return {"config": {"systems": list(table), "workload": {"chat_tier": "interactive"}},
            "runs": runs, "records": records, "goodput": gp}


def by_name(gs, system):
    return {g.name: g for g in gs if g.system == system}


def test_every_goal_from_a_run_with_a_knee():
    res = results({
        # the baseline meets 90% at 0.5 and 1.0, drops to 50% at 2.0: goodput 1.0 + (1.0-0.9)/(1.0-0.5) = 1.2
        "vllm-fcfs": [(1.0, 1.0, 100, 0.2), (1.0, 1.0, 190, 0.4), (0.5, 0.4, 200, 4.0)],
        # the priority baseline is a bit better: goodput 1.0 + (0.95-0.9)/(0.95-0.7) = 1.2
        "vllm-priority": [(1.0, 1.0, 100, 0.2), (0.95, 1.0, 190, 0.3), (0.7, 0.9, 200, 1.0)],
        # Skyline meets the goal at every rate: goodput >= 2.0, a lower bound
        "skyline-colocated": [(1.0, 1.0, 95, 0.1), (1.0, 1.0, 185, 0.15), (0.95, 0.98, 186, 0.3)],
    })
    g = by_name(goals(res), "skyline-colocated")
    assert g["goodput vs the better vLLM"].value == pytest.approx(2.0 / 1.2)
    assert g["goodput vs the better vLLM"].met is True  # a lower bound already above 1.5x
    # vLLM's goodput 1.2 -> the highest swept rate at or below it is 1.0: 150 ms vs 400 ms
    ttft = g["interactive p99 TTFT at the baseline's goodput rate"]
    assert ttft.value == pytest.approx(0.15 / 0.4) and ttft.met is True and "at 1 req/s" in ttft.detail
    sat = g["output tok/s at saturation"]  # best rates: 186 (at 2.0) vs 200 (at 2.0)
    assert sat.value == pytest.approx(186 / 200) and sat.met is True
    # vllm-fcfs first drops below 90% at 2.0 req/s
    inter = g["interactive attainment where vllm-fcfs < 90%"]
    assert inter.value == pytest.approx(0.98) and inter.met is True and "at 2 req/s" in inter.detail
    assert g["output tok/s where vllm-fcfs < 90%"].value == pytest.approx(186 / 200)
    assert {x.system for x in goals(res)} == {"skyline-colocated"}  # vLLM systems are not judged


def test_goals_that_the_run_cannot_tell_say_why():
    res = results({
        "vllm-fcfs": [(1.0, 1.0, 100, 0.2), (1.0, 1.0, 190, 0.4), (0.95, 1.0, 200, 0.5)],
        "skyline-disagg": [(0.5, 0.5, 50, 2.0), (0.2, 0.1, 60, 3.0), (0.1, 0.0, 61, 4.0)],
    })
    g = by_name(goals(res), "skyline-disagg")
    assert g["goodput vs the better vLLM"].met is None and "< 0.50" in g["goodput vs the better vLLM"].detail
    knee = [x for x in goals(res) if "where vllm-fcfs" in x.name]
    assert all(x.met is None and "sweep higher" in x.detail for x in knee)
    sat = g["output tok/s at saturation"]
    assert sat.value == pytest.approx(61 / 200) and sat.met is False


def test_a_capped_baseline_bounds_the_goodput_ratio_from_above():
    # The contender crosses 90% at 1.5 req/s; the baseline never did: the ratio is at most 1.5/2.0.
    res = results({
        "vllm-fcfs": [(1.0, 1.0, 100, 0.2), (1.0, 1.0, 190, 0.4), (0.95, 1.0, 200, 0.5)],
        "skyline-colocated": [(1.0, 1.0, 100, 0.2), (1.0, 1.0, 190, 0.4), (0.8, 0.8, 200, 0.5)],
    })
    gp = next(x for x in goals(res) if x.name == "goodput vs the better vLLM")
    assert gp.value == pytest.approx(1.5 / 2.0) and gp.met is False and ">= 2.00" in gp.detail


def test_tier_p99_ignores_failed_requests_and_other_rates():
    res = results({"vllm-fcfs": [(1.0, 1.0, 100, 0.2), (1.0, 1.0, 100, 0.4), (1.0, 1.0, 100, 0.6)]})
    res["records"].append({"system": "vllm-fcfs", "rate": 1.0, "tier": "interactive", "outcome": "rejected",
                           "ttft_s": 0.0})
    assert tier_ttft_p99_ms(res, "vllm-fcfs", 1.0, "interactive") == pytest.approx(400)
    assert tier_ttft_p99_ms(res, "vllm-fcfs", 1.0, "standard") is None
