import pytest

from skyline.scheduler.admission import AdmissionPolicy, TtftCalibration, decide, handoff_wait_ms, prefill_is_faster
from skyline.scheduler.disagg import DisaggPolicy, route
from skyline.scheduler.decode_room import paced_claim_due
from skyline.scheduler.edf import pick_tier, start_by_ms
from skyline.scheduler.tiers import DEFAULT_TIERS, SloError, TierNotAllowed, allowed_tiers, resolve_slo, tier_for_ttft

ORDER = ("interactive", "standard", "batch")


def test_edf_picks_the_earliest_head_deadline():
    assert pick_tier({"interactive": 5_000, "standard": 3_000}, ORDER) == "standard"
    assert pick_tier({"batch": 10, "interactive": 11}, ORDER) == "batch"


def test_edf_ties_go_to_the_stricter_tier_and_empty_is_none():
    assert pick_tier({"batch": 7, "interactive": 7, "standard": 7}, ORDER) == "interactive"
    assert pick_tier({}, ORDER) is None


def test_a_head_must_start_its_prompt_time_before_its_deadline():
    # 1,500 prompt tokens at 300 tokens/s take 5 s: due at 10 s, it must start by 5 s.
    assert start_by_ms(10_000, 1_500, 300.0) == 5_000
    assert start_by_ms(10_000, 0, 300.0) == 10_000  # a KV hand-off computes no prompt
    assert start_by_ms(10_000, 1_500, 0.0) == 10_000  # no rate: the deadline


def test_a_long_prompt_goes_before_short_ones_due_earlier_once_it_must_start_first():
    # The mixed benchmark's case: a RAG prompt (1,500 tokens, 7.1 s target) queued at 0 and chats
    # (150 tokens, 574 ms target) arriving after it, engines computing 300 tokens/s.
    rate = 300.0
    rag = start_by_ms(7_100, 1_500, rate)  # 2,100 ms

    def chat(arrived_ms: int) -> int:
        return start_by_ms(arrived_ms + 574, 150, rate)  # arrival + 74 ms

    # By deadline every chat of the next 6.5 s goes first; by latest start only those that must start sooner.
    assert pick_tier({"interactive": 6_000 + 574, "standard": 7_100}, ORDER) == "interactive"
    assert pick_tier({"interactive": chat(2_000), "standard": rag}, ORDER) == "interactive"
    assert pick_tier({"interactive": chat(2_100), "standard": rag}, ORDER) == "standard"
    # Equal sizes: the same order as by deadline.
    assert (start_by_ms(500, 100, rate) < start_by_ms(600, 100, rate)) is (500 < 600)


def test_a_worker_the_pace_rule_holds_back_claims_only_what_must_start_now():
    assert paced_claim_due(start_by_ms=1_000, now_ms=1_000)
    assert paced_claim_due(start_by_ms=900, now_ms=1_000)
    assert not paced_claim_due(start_by_ms=1_001, now_ms=1_000)


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


def test_a_short_prompt_goes_to_the_prefill_pool_only_when_that_is_predicted_faster():
    policy = DisaggPolicy("disagg", 256)
    assert route(policy, 128, prefill_faster=lambda: True) == "disagg"
    assert route(policy, 128, prefill_faster=lambda: False) == "colocated"
    asked = []
    assert route(policy, 300, prefill_faster=lambda: asked.append(1) or False) == "disagg"  # long: never asked
    assert route(DisaggPolicy("colocated", 256), 128, prefill_faster=lambda: asked.append(1) or True) == "colocated"
    assert not asked


def test_the_faster_stage_is_admission_controls_prediction_on_each_stages_queue():
    """128 tokens; both pools measured at 1,000 tokens/s; 150 ms first-token overhead."""
    a = AdmissionPolicy(prior_prefill_tokens_per_s=1_000.0, first_token_overhead_ms=150.0)
    rates = {"prefill": 1_000.0, "decode": 1_000.0}

    def faster(prefill: dict, decode: dict, tier: str = "interactive", **kw) -> bool:
        return prefill_is_faster(a, DEFAULT_TIERS, tier, 128, 128, {"prefill": prefill, "decode": decode},
                                 kw.get("rates", rates), kw.get("calibration"))

    assert not faster({}, {})  # nothing waits on the decode worker: no KV to move is cheapest
    assert faster({}, {"interactive": 256})  # the prefill pool 278 ms, the decode worker 534 ms
    assert not faster({"interactive": 512}, {"interactive": 256})
    assert not faster({"interactive": 256}, {"interactive": 256})  # a tie stays where it is
    # Only what EDF serves first counts: batch prompts queued on the decode worker are not ahead.
    assert not faster({}, {"batch": 5_000})
    assert faster({"batch": 5_000}, {"interactive": 100})
    # A stage's pool rate and its calibration price its queue.
    assert not faster({}, {"interactive": 256}, rates={"prefill": 250.0, "decode": 1_000.0})
    cal = TtftCalibration()
    for _ in range(50):
        cal.observe(("decode", "interactive"), 400.0, 100.0)  # the decode worker beats its prediction
    assert not faster({}, {"interactive": 256}, calibration=cal)


def test_a_prompt_handed_to_a_busy_decode_worker_waits_for_one_of_its_steps():
    """The first token of a prompt prefilled in the prefill pool comes from a decode-worker step; while
    that worker computes prompts of its own, the step carries up to a step's worth of them."""
    a = AdmissionPolicy(prior_prefill_tokens_per_s=1_000.0, first_token_overhead_ms=150.0, decode_step_tokens=256)
    rates = {"prefill": 1_000.0, "decode": 1_000.0}
    assert handoff_wait_ms(a, DEFAULT_TIERS, "interactive", {}, 1_000.0) == 0.0
    assert handoff_wait_ms(a, DEFAULT_TIERS, "interactive", {"interactive": 100}, 1_000.0) == 100.0
    assert handoff_wait_ms(a, DEFAULT_TIERS, "interactive", {"interactive": 5_000}, 500.0) == 512.0  # one step
    assert handoff_wait_ms(a, DEFAULT_TIERS, "interactive", {"batch": 5_000}, 1_000.0) == 0.0  # not ahead
    # Without the wait, 200 tokens queued on the decode worker sent a 128-token prompt away
    # (278 < 478 ms); with it the prefill route is 478 ms too, and the prompt stays.
    def faster(decode: dict) -> bool:
        return prefill_is_faster(a, DEFAULT_TIERS, "interactive", 128, 128, {"prefill": {}, "decode": decode}, rates)

    assert not faster({"interactive": 200})
    assert faster({"interactive": 600})  # 534 ms from the prefill pool against 878 ms
    # Admission on the disaggregated route prices the same wait.
    d, model = decide(a, DEFAULT_TIERS, "interactive", 1_000, 128, "prefill", {}, None, handoff_ms=256.0)
    assert d.action == "admit" and d.predicted_ttft_ms == model == 128 + 150 + 256


def test_a_tenant_capped_at_a_tier_gets_it_by_default_and_every_looser_one_on_request():
    capped = resolve_slo(DEFAULT_TIERS, "interactive", 0, strictest="standard")  # default stricter than allowed
    assert (capped.tier, capped.ttft_ms) == ("standard", 5_000)
    assert resolve_slo(DEFAULT_TIERS, "interactive", 0, tier="batch", strictest="standard").tier == "batch"
    assert resolve_slo(DEFAULT_TIERS, "standard", 0, ttft_ms=5_000, strictest="standard").tier == "standard"
    assert [t.name for t in allowed_tiers(DEFAULT_TIERS, "standard")] == ["standard", "batch"]
    assert allowed_tiers(DEFAULT_TIERS, "") == DEFAULT_TIERS


@pytest.mark.parametrize("kw, by_target, says", [
    ({"tier": "interactive"}, False, "SLO tier 'interactive' is stricter"),
    ({"ttft_ms": 4_999}, True, "a TTFT target of 4999 ms needs SLO tier 'interactive'"),
    ({"tier": "batch", "ttft_ms": 800}, True, "needs SLO tier 'interactive'"),
])
def test_a_stricter_tier_than_the_tenant_may_use_is_refused_not_quietly_loosened(kw, by_target, says):
    with pytest.raises(TierNotAllowed) as exc:
        resolve_slo(DEFAULT_TIERS, "standard", 0, strictest="standard", **kw)
    assert exc.value.by_target is by_target
    assert says in str(exc.value) and "it may use: standard, batch" in str(exc.value)
