"""Who claims a new prompt first: the worker computing least (scheduler/claiming.py `claim_defer_s`)."""

from skyline.scheduler.claiming import CLAIM_DEFER_MAX_S, claim_defer_s


def test_an_engine_computing_nothing_claims_at_once():
    assert claim_defer_s(128, 1, 0, [], 200.0) == 0.0


def test_a_kv_hand_off_is_claimed_at_once_however_busy_the_engine():
    assert claim_defer_s(0, 1, 1024, [1], 200.0) == 0.0


def test_a_busy_engine_waits_about_as_long_as_its_prompts_take_capped():
    assert claim_defer_s(128, 1, 20, [1], 200.0) == 0.1
    assert claim_defer_s(128, 1, 1024, [1], 200.0) == CLAIM_DEFER_MAX_S


def test_less_work_held_claims_sooner():
    assert claim_defer_s(128, 1, 10, [1], 200.0) < claim_defer_s(128, 1, 30, [1], 200.0)


def test_a_stricter_tier_than_anything_computing_is_claimed_at_once_to_preempt():
    assert claim_defer_s(128, 0, 1024, [1, 2], 200.0) == 0.0
    assert claim_defer_s(128, 1, 1024, [1, 2], 200.0) > 0  # as strict as one computing: no preemption


def test_no_measured_rate_means_no_wait():
    assert claim_defer_s(128, 1, 1024, [1], 0.0) == 0.0


def test_off_when_configured_so():
    assert claim_defer_s(128, 1, 1024, [1], 200.0, max_s=0.0) == 0.0
