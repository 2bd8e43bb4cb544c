"""The stall rule (scheduler/stall.py): when an engine that holds requests counts as stuck."""

from __future__ import annotations

from skyline.scheduler.stall import StallWatch


def _run(checks: list[tuple[float, int, bool]]) -> list[float]:
    watch = StallWatch(period_s=1.0)
    return [watch.check(t, steps, busy) for t, steps, busy in checks]


def test_busy_without_a_step_counts_up_from_the_first_check_that_sees_it():
    assert _run([(0, 5, True), (1, 5, True), (2, 5, True), (3.5, 5, True)]) == [0, 1, 2, 3.5]


def test_a_step_or_an_idle_engine_restarts_the_count():
    assert _run([(0, 5, True), (1, 5, True), (2, 6, True), (3, 6, True), (4, 6, False), (5, 6, False),
                 (6, 6, True), (7, 6, True)]) == [0, 1, 0, 1, 0, 0, 0, 1]


def test_an_idle_engine_is_never_stalled():
    assert _run([(float(t), 0, False) for t in range(100)]) == [0] * 100


def test_a_late_check_says_nothing_about_the_engine():
    # The worker process itself was paused for 30 s: the steps of that gap may still be queued.
    assert _run([(0, 5, True), (1, 5, True), (31, 5, True), (32, 5, True), (33, 5, True)]) == [0, 1, 0, 1, 2]
    # Slightly late checks (a busy event loop) still count.
    assert _run([(0, 5, True), (2.5, 5, True), (5, 5, True)]) == [0, 2.5, 5]
