import math

import pytest
from skyline.scheduler.admission import AdmissionPolicy, FleetLoad, TtftCalibration, admit, predict_ttft_ms
from skyline.scheduler.decode_room import TokenPaceMeter, tpot_room
from skyline.scheduler.preemption import (
    PreemptionPolicy,
    Running,
    Shield,
    Waiting,
    choose_victims,
    tokens_until_done,
)
from skyline.scheduler.throughput import ThroughputMeter
from skyline.scheduler.tiers import DEFAULT_TIERS

POLICY = AdmissionPolicy(prior_prefill_tokens_per_s=1000, first_token_overhead_ms=100)


def load(queued=None, rate=1000.0):
    return FleetLoad(queued_tokens=queued or {}, prefill_tokens_per_s=rate)


def test_prediction_counts_only_work_served_before_the_request():
    q = {"interactive": 200, "standard": 300, "batch": 10_000}
    # interactive: only its own tier; the batch backlog is served after it
    assert predict_ttft_ms(POLICY, DEFAULT_TIERS, "interactive", 100, load(q)) == (200 + 100) + 100
    # standard: interactive and standard are ahead
    assert predict_ttft_ms(POLICY, DEFAULT_TIERS, "standard", 100, load(q)) == (200 + 300 + 100) + 100


def test_unknown_throughput_uses_the_prior():
    assert predict_ttft_ms(POLICY, DEFAULT_TIERS, "batch", 900, load(rate=None)) == 900 + 100


def test_admit_reject_boundary():
    # 1000 ms target: 800 queued + 100 own tokens at 1000 tok/s + 100 ms overhead = exactly 1000 ms
    assert admit(POLICY, DEFAULT_TIERS, "interactive", 1000, 100, load({"interactive": 800})).action == "admit"
    d = admit(POLICY, DEFAULT_TIERS, "interactive", 1000, 101, load({"interactive": 800}))
    assert d.action == "reject" and d.retry_after_s == 1 and "interactive" in d.reason


def test_a_request_with_nothing_ahead_is_never_shed():
    # Even a prompt predicted to take longer than its target: waiting cannot make it faster.
    slow = load({"batch": 50_000}, rate=10.0)
    assert admit(POLICY, DEFAULT_TIERS, "interactive", 1000, 500, slow).action == "admit"


def test_retry_after_reflects_how_far_over_the_target():
    d = admit(POLICY, DEFAULT_TIERS, "interactive", 1000, 100, load({"interactive": 5_000}))
    assert d.action == "reject" and d.retry_after_s == math.ceil((5_200 - 1_000) / 1000)


def test_demotion_when_the_client_allows_it():
    d = admit(POLICY, DEFAULT_TIERS, "interactive", 1000, 100, load({"interactive": 3_000}), allow_demotion=True)
    assert d.action == "demote" and d.tier == "standard"


def test_non_sheddable_tiers_queue_but_the_backlog_is_bounded():
    huge = load({"batch": 500_000})
    assert admit(POLICY, DEFAULT_TIERS, "batch", 60_000, 1000, huge).action == "admit"
    small = AdmissionPolicy(max_queued_tokens=10_000)
    d = admit(small, DEFAULT_TIERS, "batch", 60_000, 1000, load({"batch": 9_500}))
    assert d.action == "overloaded" and d.retry_after_s > 0


def test_no_preemption_when_the_head_can_wait():
    running = [Running("b1", 2, 99_000, 500, 0)]
    head = Waiting(0, deadline_ms=2_000, prompt_tokens=100)
    assert choose_victims(PreemptionPolicy(), running, head, now_ms=0, tokens_per_s=1000) == []


def test_preempts_the_least_urgent_requests_until_the_head_fits():
    running = [Running("std", 1, 9_000, 1500, 0), Running("b-early", 2, 50_000, 1500, 0), Running("b-late", 2, 60_000, 10, 0)]
    # 1,000 ms at 1,000 tok/s leaves room for 900 tokens besides the head's 100:
    # every looser request must go, loosest tier and latest deadline first.
    head = Waiting(0, deadline_ms=1_000, prompt_tokens=100)
    assert choose_victims(PreemptionPolicy(), running, head, now_ms=0, tokens_per_s=1000) == ["b-late", "b-early", "std"]
    # With 3 s of slack, dropping the batch prompts is enough; the standard one stays.
    head = Waiting(0, deadline_ms=3_000, prompt_tokens=100)
    assert choose_victims(PreemptionPolicy(), running, head, now_ms=0, tokens_per_s=1000) == ["b-late", "b-early"]


def test_a_prompt_past_its_latest_start_is_not_aborted():
    # At 300 tokens/s a 1,500-token RAG prompt due at 7,100 ms must start by 2,100 ms. A chat that would
    # miss behind it may abort it before then (restarted, it can still make it), not after (it could not).
    rag = [Running("rag", 1, 7_100, 1_500, 0)]
    assert choose_victims(PreemptionPolicy(), rag, Waiting(0, 2_574, 150), 2_000, 300) == ["rag"]
    assert choose_victims(PreemptionPolicy(), rag, Waiting(0, 2_774, 150), 2_200, 300) == []


def test_tokens_until_done_follows_vllm_steps_with_and_without_a_cap():
    # No cap: the running prompts' remaining work, then the head's.
    assert tokens_until_done([1000], 74) == 1074
    assert tokens_until_done([1000], 74, step_tokens=256, cap=0) == 1074
    # Cap 128 in 256-token steps: after the step in progress (256), the running prompt takes
    # 128 a step, the head the other 128.
    assert tokens_until_done([1000], 74, 256, 128) == 256 + 128 + 74
    assert tokens_until_done([1000], 294, 256, 128) == 256 + 3 * 128 + 294  # 128+128, 128+128, 128+38
    # The running prompt finishes first: the head is then alone and takes whole steps.
    assert tokens_until_done([100], 294, 256, 128) == 100 + 100 + 294  # (100), 100+128, then 166 alone
    # Two running prompts fill the step between them: the head waits until one is done.
    assert tokens_until_done([300, 1000], 74, 256, 128) == 256 + (128 + 128) * 2 + 44 + 128 + 74


def test_a_capped_engine_preempts_only_for_heads_that_sharing_the_step_would_make_late():
    """1,000 ms to the deadline at 1,000 tokens/s: room for 1,000 tokens of engine work."""
    capped = PreemptionPolicy(step_tokens=256, prefill_cap=128)
    rag = [Running("rag", 2, 60_000, 1500, 0)]
    # A 100-token chat shares the step after the one in progress (256 + 228 tokens of work):
    # no need to abort the RAG prompt.
    assert choose_victims(capped, rag, Waiting(0, 1_000, 100), 0, 1000) == []
    # Uncapped, the same chat waits for the RAG prompt's 1,500 tokens: preempt.
    assert choose_victims(PreemptionPolicy(), rag, Waiting(0, 1_000, 100), 0, 1000) == ["rag"]
    # A 400-token chat sharing steps takes 4 of them (256 + 400 + 4 x 128 tokens): too late, preempt.
    assert choose_victims(capped, rag, Waiting(0, 1_000, 400), 0, 1000) == ["rag"]


def test_a_shield_limits_claims_to_its_tiers_until_their_work_is_done_or_its_deadline():
    shield = Shield(rank=0, until_ms=1_000)
    assert shield.limit(999) == 0 and shield.limit(1_000) is None  # expires at the protected deadline
    assert not shield.lifts([0, 2]) and not shield.lifts([0])  # an interactive prompt still computes here
    assert shield.lifts([1, 2]) and shield.lifts([])  # only looser work left: claim anything again
    both = Shield(1, 800).merged(shield)
    assert both == Shield(1, 1_000) and Shield(1, 800).merged(None) == Shield(1, 800)


def test_preemption_never_hits_same_or_stricter_tiers_and_is_bounded():
    head = Waiting(1, deadline_ms=1_000, prompt_tokens=100)
    assert choose_victims(PreemptionPolicy(), [Running("i", 0, 500, 5000, 0)], head, 0, 1000) == []
    assert choose_victims(PreemptionPolicy(), [Running("s", 1, 500, 5000, 0)], head, 0, 1000) == []
    exhausted = [Running("b", 2, 90_000, 5000, 2)]
    assert choose_victims(PreemptionPolicy(max_preemptions=2), exhausted, head, 0, 1000) == []
    assert choose_victims(PreemptionPolicy(enabled=False), [Running("b", 2, 90_000, 5000, 0)], head, 0, 1000) == []


def test_throughput_meter_uses_busy_time_not_per_request_time():
    m = ThroughputMeter()
    assert m.tokens_per_s(0) is None
    # Two overlapping prefills of 1000 tokens over [0, 2000] ms: 1000 tokens/s, not 500.
    m.record(0, 2000, 1000)
    m.record(0, 2000, 1000)
    assert m.tokens_per_s(2000) == 1000
    # An idle gap does not count as busy time.
    m.record(10_000, 11_000, 1000)
    assert m.tokens_per_s(11_000) == 3000 / 3


def test_throughput_meter_forgets_old_work():
    m = ThroughputMeter(window_ms=1000)
    m.record(0, 100, 100)
    assert m.tokens_per_s(5000) is None


def test_throughput_meter_keeps_its_answer_only_while_it_holds():
    """A kept answer is the one measured afresh at every read: random samples, windows and read
    times, reads repeated, a sample expiring between two reads, and time going back."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        window = rng.choice([50, 500, 30_000])
        kept, fresh_samples = ThroughputMeter(window_ms=window, max_samples=rng.choice([4, 256])), []
        now = 0
        for _ in range(60):
            now += rng.choice([0, 0, 1, 7, 40, 300, 2_000]) if rng.random() > 0.05 else -rng.randint(1, 100)
            if rng.random() < 0.3:
                start = now - rng.randint(0, 400)
                end = start + rng.randint(0, 400)
                tokens = rng.randint(0, 2_000)
                kept.record(start, end, tokens)
                fresh_samples.append((start, end, tokens))
            fresh = ThroughputMeter(window_ms=window, max_samples=kept.max_samples)
            for sample in fresh_samples:
                fresh.record(*sample)
            assert kept.tokens_per_s(now) == fresh.tokens_per_s(now), (now, fresh_samples)


def test_calibration_scales_predictions_by_their_measured_error():
    cal = TtftCalibration()
    assert cal.scale(("decode", "interactive")) == 1.0  # nothing measured: the model as is
    for _ in range(40):  # short prompts: the pool rate (dominated by long ones) was pessimistic
        cal.observe(("decode", "interactive"), predicted_ms=600, measured_ms=300)
    assert cal.scale(("decode", "interactive")) == pytest.approx(0.5, rel=0.02)
    assert cal.scale(("decode", "standard")) == 1.0  # per key
    # The scaled prediction admits what the raw one refused: 100 + 500 tokens at 1,000 tokens/s
    # + 100 ms = 700 ms raw against a 600 ms target; scaled by 0.5, 350 ms.
    raw = load({"interactive": 100}, rate=1000)
    assert admit(POLICY, DEFAULT_TIERS, "interactive", 600, 500, raw).action == "reject"
    scaled = FleetLoad({"interactive": 100}, 1000, cal.scale(("decode", "interactive")))
    d = admit(POLICY, DEFAULT_TIERS, "interactive", 600, 500, scaled)
    assert d.action == "admit" and d.predicted_ttft_ms == pytest.approx(350, rel=0.02)


def test_calibration_is_bounded_and_ignores_nonsense():
    cal = TtftCalibration()
    for _ in range(200):
        cal.observe("k", predicted_ms=100, measured_ms=10_000)  # a stall, or a cold engine: never scaled up
    assert cal.scale("k") == 1.0
    for _ in range(200):
        cal.observe("k", predicted_ms=1000, measured_ms=1)  # a model far too pessimistic: halved at most
    assert cal.scale("k") == pytest.approx(0.5, rel=1e-6)
    for bad in ((0, 100), (100, 0), (float("inf"), 100), (-5, 100)):
        cal.observe("k", *bad)
    assert cal.scale("k") == pytest.approx(0.5, rel=1e-6)
    for _ in range(30):  # slower than predicted again: the scale climbs back towards the model
        cal.observe("k", predicted_ms=100, measured_ms=300)
    assert 0.9 < cal.scale("k") <= 1.0


def test_token_pace_meter_is_a_token_weighted_mean_over_its_window():
    m = TokenPaceMeter(window_s=10.0)
    assert m.seconds_per_token(0.0) is None
    m.record(10.0, 0.05, 1)  # 50 ms for one token
    m.record(15.0, 0.30, 2)  # a chunk of two tokens 300 ms after the previous: 150 ms each
    assert m.seconds_per_token(16.0) == pytest.approx((0.05 + 2 * 0.15) / 3)
    assert m.seconds_per_token(20.5) == pytest.approx(0.15)  # the first gap left the window
    assert m.seconds_per_token(25.5) is None  # nothing streamed for 10 s: no evidence either way


def test_tpot_room_boundary():
    assert tpot_room(0.159, 199, 0.8, held=5)  # 159 ms < 0.8 x 199 = 159.2 ms
    assert not tpot_room(0.160, 199, 0.8, held=5)
    assert tpot_room(None, 199, 0.8, held=5) and tpot_room(0.5, None, 0.8, held=5)  # nothing measured / running
    assert tpot_room(10.0, 199, 0.0, held=5)  # disabled
    assert tpot_room(10.0, 199, 0.8, held=1)  # a lone stream: refusing company would not speed it up
