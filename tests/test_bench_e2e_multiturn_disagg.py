"""`skyline bench run --workload multiturn` end to end on the disaggregated sim fleets, affinity on and off.

Real processes (Redis, gateway, 1 prefill + 1 decode worker on the `sim` engine), one rate of a few
seconds. Issue 21 item 4: a prompt whose history the decode worker holds (the next turn of a
conversation) has only its new tokens to compute, so it skips the prefill pool however long it is,
and the decode worker then reports most of it cached; a prompt with a long new part (a question over
a document the decode worker does not hold yet) still goes through the prefill pool.

With one decode worker prefix affinity places nothing; what it changes is the route: with
`[gateway] prefix_affinity = false` the gateway reads no cache view and routes on prompt length, so the
same turns go through the prefill pool.
"""

from __future__ import annotations

import pytest

from skyline.core.config import GatewayConfig
from tests.multiturn_bench import run_multiturn

SYSTEMS = ["sim-disagg-affinity", "sim-disagg-no-affinity"]
RATE = 2.0
# Shorter prompts are prefilled on the decode worker whatever it holds: only longer ones show the cache at work.
MIN_REMOTE = GatewayConfig().min_remote_prefill_tokens


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    return run_multiturn(tmp_path_factory.mktemp("bench-multiturn-disagg"), SYSTEMS, RATE, 3, 0.67)


def _served(results, system: str) -> list[dict]:
    return [r for r in results["records"] if r["system"] == system and r["outcome"] == "ok"]


def _prompt(r: dict) -> int:
    return r["server_prompt_tokens"] or r["prompt_tokens"]


def _later_long(results, system: str) -> tuple[list[dict], list[dict]]:
    """Later turns long enough for the prefill pool, and those of them that skipped it."""
    later = [r for r in _served(results, system) if r["turn"] >= 1 and _prompt(r) >= MIN_REMOTE]
    return later, [r for r in later if r["skyline"]["route"] == "colocated"]


@pytest.mark.parametrize("system", SYSTEMS)
def test_both_fleets_serve_and_place_nothing(bench_run, system):
    results, _ = bench_run
    assert results["systems"][system]["status"] == "ok"
    served = _served(results, system)
    sent = [r for r in results["records"] if r["system"] == system]
    assert len(served) >= 0.8 * len(sent) > 0, [(r["outcome"], r["error"]) for r in sent]
    assert all(r["skyline"]["placement"] is None for r in served)  # one decode worker: nothing to place
    # The fleet does disaggregate: what the decode worker does not hold goes through the prefill pool.
    through = [r for r in served if r["skyline"]["route"] == "disagg"]
    assert through and all(r["skyline"]["prefill_worker"] and r["cached_tokens"] is None for r in through)


def test_a_turn_whose_history_the_decode_worker_holds_skips_the_prefill_pool(bench_run):
    results, _ = bench_run
    later, skipped = _later_long(results, "sim-disagg-affinity")
    detail = [(r["session"], r["turn"], _prompt(r), r["skyline"]["route"], r["cached_tokens"]) for r in later]
    assert later and len(skipped) >= 0.5 * len(later), detail
    # Long enough for the prefill pool, yet routed to the decode worker: only its cache could do that,
    # and its engine then computed fewer tokens than the bound (the route's count was right).
    for r in (r for r in _served(results, "sim-disagg-affinity")
              if r["skyline"]["route"] == "colocated" and _prompt(r) >= MIN_REMOTE):
        assert 0 < r["cached_tokens"] and _prompt(r) - r["cached_tokens"] < MIN_REMOTE, r["skyline"]


def test_with_affinity_off_the_route_ignores_the_cache(bench_run):
    results, _ = bench_run
    later, skipped = _later_long(results, "sim-disagg-no-affinity")
    # Routed on prompt length: a long prompt skips the prefill pool only when that pool's backlog is
    # past its bound (scheduler/disagg.py), which this light load never reaches.
    assert later and not skipped, [(r["turn"], _prompt(r), r["skyline"]) for r in skipped]


def test_the_report_says_how_many_skipped_the_prefill_pool(bench_run):
    results, out = bench_run
    md = (out / "report.md").read_text()
    assert "| prefix-cache hit | oracle hit | of oracle |" in md
    assert "in blocks of 16 tokens (sim-disagg-affinity, sim-disagg-no-affinity)" in md
    for run in results["runs"]:
        routes, served = run["summary"]["routes"], _served(results, run["system"])
        assert routes["colocated"] == sum(r["skyline"]["route"] == "colocated" for r in served)
        assert routes["disagg"] == sum(r["skyline"]["route"] == "disagg" for r in served) > 0
        assert sum(routes["later_turns"].values()) == sum(r["turn"] >= 1 for r in served)
        pc = run["summary"]["prefix_cache"]  # hits only of what skipped the prefill pool, and the oracle's of those
        assert pc["block_size"] == 16, pc
        if run["system"] == "sim-disagg-affinity":
            assert 0 < pc["of_oracle"] <= 1, pc
        else:  # only short prompts skip the prefill pool: the oracle may hit nothing of them
            assert pc["of_oracle"] is None or pc["of_oracle"] <= 1, pc
        share = routes["colocated"] / (routes["colocated"] + routes["disagg"])
        assert f"{run['system']} at {RATE:g}: {100 * share:.0f}% / " in md
    assert "Skipped the prefill pool (route colocated)" in md
