"""The batch pacing controller (pure): fills idle capacity, steps aside when live queues grow."""

import pytest
from skyline.scheduler.batch_pacing import BatchPacer, FleetLoad, PacingPolicy, fleet_load, slo_pressure, stricter_tiers
from skyline.scheduler.tiers import DEFAULT_TIERS, Tier

TIERS = DEFAULT_TIERS + (Tier("scavenger", ttft_ms=600_000, tpot_ms=10_000, priority=3),)

POLICY = PacingPolicy(min_concurrency=1, max_concurrency=16, start_concurrency=4, backoff_tokens=1000,
                      fill_tokens=100, max_batch_backlog_tokens=5000, increase_step=2, decrease_factor=0.5)


def idle(batch_tokens: int = 0) -> FleetLoad:
    return FleetLoad(stricter_tokens=0, batch_tokens=batch_tokens)


def test_an_idle_fleet_is_filled_step_by_step_up_to_the_maximum():
    pacer = BatchPacer(POLICY)
    limits = [pacer.observe(idle()) for _ in range(8)]
    assert limits == [6, 8, 10, 12, 14, 16, 16, 16]


def test_a_burst_of_live_traffic_halves_the_limit_at_once_down_to_the_minimum():
    pacer = BatchPacer(POLICY)
    for _ in range(6):
        pacer.observe(idle())
    assert pacer.limit == 16
    burst = FleetLoad(stricter_tokens=5000, batch_tokens=0)
    assert [pacer.observe(burst) for _ in range(5)] == [8, 4, 2, 1, 1]


def test_a_growing_live_queue_backs_off_even_below_the_backoff_threshold():
    pacer = BatchPacer(POLICY)
    pacer.observe(idle())  # 6
    assert pacer.observe(FleetLoad(300, 0)) == 3  # above fill and grew from 0
    assert pacer.observe(FleetLoad(300, 0)) == 3  # above fill, steady: hold
    assert pacer.observe(FleetLoad(200, 0)) == 3  # above fill, draining: hold
    assert pacer.observe(FleetLoad(50, 0)) == 5  # drained: fill in again


def test_no_fill_in_while_the_batch_tier_already_has_a_queue_of_its_own():
    pacer = BatchPacer(POLICY)
    assert pacer.observe(idle(batch_tokens=5000)) == 4  # more in flight would only wait in Redis
    assert pacer.observe(idle(batch_tokens=4999)) == 6


def test_gateway_pushback_backs_off_like_a_growing_queue():
    pacer = BatchPacer(POLICY)
    assert pacer.pushback() == 2
    assert pacer.pushback() == 1
    assert pacer.pushback() == 1


def test_a_zero_minimum_pauses_the_batch_under_load():
    pacer = BatchPacer(PacingPolicy(min_concurrency=0, start_concurrency=1, max_concurrency=4))
    assert pacer.observe(FleetLoad(10**6, 0)) == 0
    assert pacer.observe(FleetLoad(0, 0)) == 2  # and it comes back once the queue drains


def test_backlog_hash_is_split_into_stricter_tiers_and_the_batch_tier():
    stricter = stricter_tiers(TIERS, "batch")
    assert set(stricter) == {"interactive", "standard"}
    backlog = {"prefill:interactive": 300, "decode:standard": 200, "prefill:batch": 900, "decode:batch": 100,
               "prefill:scavenger": 5000, "prefill:retired-tier": 777, "prefill:standard": -5}
    assert fleet_load(backlog, stricter, "batch", 0.3) == FleetLoad(500, 1000, 0.3)


def test_live_latency_near_its_target_backs_off_before_any_miss():
    pacer = BatchPacer(POLICY)
    assert pacer.observe(FleetLoad(0, 0, slo_pressure=0.85)) == 2  # TPOT at 85% of target: decode is contended
    assert pacer.observe(FleetLoad(0, 0, slo_pressure=0.6)) == 2  # comfortable but not idle: hold
    assert pacer.observe(FleetLoad(0, 0, slo_pressure=0.4)) == 4


def test_slo_pressure_is_the_worst_new_stricter_answer():
    stricter = stricter_tiers(TIERS, "batch")  # interactive: 1000/250 ms, standard: 5000/500 ms
    answers = [
        {"tier": "interactive", "t_ms": 1_000, "ttft_ms": 900, "tpot_ms": 10, "slo_met": True, "status": 200},  # old
        {"tier": "interactive", "t_ms": 2_000, "ttft_ms": 100, "tpot_ms": 200, "slo_met": True, "status": 200},
        {"tier": "standard", "t_ms": 2_500, "ttft_ms": 1000, "tpot_ms": 100, "slo_met": True, "status": 200},
        {"tier": "batch", "t_ms": 3_000, "ttft_ms": 50_000, "tpot_ms": 1900, "slo_met": True, "status": 200},
    ]
    assert slo_pressure(answers, stricter, since_ms=1_000) == (0.8, 2_500)
    assert slo_pressure(answers, stricter, since_ms=2_500) == (0.0, 2_500)  # nothing new: no pressure
    shed = [{"tier": "standard", "t_ms": 4_000, "ttft_ms": None, "tpot_ms": None, "slo_met": False, "status": 429}]
    assert slo_pressure(shed, stricter, since_ms=2_500) == (1.0, 4_000)  # a refused live request is a miss


@pytest.mark.parametrize("kwargs", [
    {"min_concurrency": 5, "start_concurrency": 4},
    {"start_concurrency": 40, "max_concurrency": 32},
    {"fill_tokens": 5000, "backoff_tokens": 100},
    {"decrease_factor": 1.0},
    {"increase_step": 0},
    {"fill_slo_pressure": 0.9, "backoff_slo_pressure": 0.8},
])
def test_inconsistent_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        PacingPolicy(**kwargs)
