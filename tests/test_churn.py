"""The ledger under churn: workers killed every few seconds, Redis restarted once.

Every request sent must end as completed (its whole output exactly once) or
failed with an error the client saw; none may be lost (silence, or a wrong or
truncated output without an error). This is `skyline bench churn`, smaller.
"""

from __future__ import annotations

import pytest

from skyline.tools.bench.churn import ChurnOptions, run

pytestmark = pytest.mark.faults


def test_nothing_is_lost_under_churn(tmp_path):
    opts = ChurnOptions(requests=50, rate=4.0, kill_every_s=2.5, prefill=2, decode=2, max_tokens=48, seed=1)
    led = run(opts, tmp_path)
    assert led.sent == 50
    assert led.completed + led.failed + led.lost == led.sent
    assert led.lost == 0, led.lost_examples
    assert led.migrated >= 1, led.events  # a decode worker died mid-stream at least once and the stream moved
    assert led.completed >= 25, led.failures  # failures cluster around the Redis restart
