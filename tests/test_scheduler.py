import pytest

from skyline.scheduler.disagg import DisaggPolicy, route
from skyline.scheduler.edf import pick_tier
from skyline.scheduler.tiers import DEFAULT_TIERS, SloError, resolve_slo, tier_for_ttft

ORDER = ("interactive", "standard", "batch")


def test_edf_picks_the_earliest_head_deadline():
    assert pick_tier({"interactive": 5_000, "standard": 3_000}, ORDER) == "standard"
    assert pick_tier({"batch": 10, "interactive": 11}, ORDER) == "batch"


def test_edf_ties_go_to_the_stricter_tier_and_empty_is_none():
    assert pick_tier({"batch": 7, "interactive": 7, "standard": 7}, ORDER) == "interactive"
    assert pick_tier({}, ORDER) is None


def test_slo_defaults_come_from_the_tier():
    slo = resolve_slo(DEFAULT_TIERS, "standard", arrival_ms=1_000)
    assert (slo.tier, slo.ttft_ms, slo.deadline_ms) == ("standard", 5_000, 6_000)


def test_a_client_may_tighten_but_not_loosen_targets():
    loose = resolve_slo(DEFAULT_TIERS, "standard", 0, tier="interactive", ttft_ms=99_999, tpot_ms=99_999)
    assert (loose.ttft_ms, loose.tpot_ms) == (1_000, 250)
    tight = resolve_slo(DEFAULT_TIERS, "standard", 0, tier="batch", ttft_ms=3_000)
    # A tightened batch request moves to the loosest tier at or below its target,
    # keeping each tier stream's FIFO order equal to deadline order.
    assert (tight.tier, tight.ttft_ms, tight.deadline_ms) == ("interactive", 3_000, 3_000)


def test_tier_for_ttft_boundaries():
    assert tier_for_ttft(DEFAULT_TIERS, 5_000).name == "standard"
    assert tier_for_ttft(DEFAULT_TIERS, 4_999).name == "interactive"
    assert tier_for_ttft(DEFAULT_TIERS, 10).name == "interactive"


@pytest.mark.parametrize("kw", [{"tier": "gold"}, {"ttft_ms": 0}, {"tpot_ms": -5}])
def test_bad_slo_requests_are_errors(kw):
    with pytest.raises(SloError):
        resolve_slo(DEFAULT_TIERS, "standard", 0, **kw)


def test_conditional_disaggregation():
    assert route(DisaggPolicy("disagg", 0), 1) == "disagg"
    assert route(DisaggPolicy("disagg", 64), 63) == "colocated"
    assert route(DisaggPolicy("disagg", 64), 64) == "disagg"
    assert route(DisaggPolicy("colocated", 0), 5_000) == "colocated"


def test_a_deep_prefill_backlog_sends_prompts_to_the_decode_pool():
    policy = DisaggPolicy("disagg", min_remote_prefill_tokens=0, max_prefill_backlog_tokens=10_000)
    assert route(policy, 500, prefill_backlog_tokens=10_000) == "disagg"
    assert route(policy, 500, prefill_backlog_tokens=10_001) == "colocated"
    assert route(DisaggPolicy("disagg"), 500, prefill_backlog_tokens=10**9) == "disagg"  # 0 = no limit
