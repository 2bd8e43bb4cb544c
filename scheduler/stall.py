"""When is an engine stuck? Long enough without a step while it holds requests.

A worker whose engine stops computing (its executor stuck in a KV transfer, say) still heartbeats, so no
other worker takes its requests over: they wait for the gateway's first-frame timeout, and every
request the worker claims afterwards waits with them. A healthy engine that holds requests steps
continually (a step waiting for remote KV is a step too), so "no step for `engine_stall_s` while
holding requests" is the signal; the worker then ends itself (workers/engine_watch.py) and the
fleet's takeover rules (workers/reaper.py) move its requests to live workers.

The time is counted by a periodic check, and only across checks that ran on time: a worker process
that was itself paused (SIGSTOP, a frozen host) finds a long gap on resuming, and the engine's
steps of that gap still queued behind its event loop; such a gap says nothing about the engine.
"""

from __future__ import annotations

# A gap between two checks longer than this many periods means the checker itself was held up.
LATE_CHECK_PERIODS = 3.0


class StallWatch:
    """Seconds an engine has held requests without completing a step, as its periodic check sees it."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.stalled_s = 0.0
        self._last_check: float | None = None
        self._last_steps: int | None = None
        self._was_busy = False

    def check(self, now: float, steps: int, busy: bool) -> float:
        """Record one check: `steps` the engine has completed so far, `busy` whether it holds requests.
        Returns the seconds it has been busy without a step (0 when it stepped, is idle, or the check
        itself was late)."""
        last = self._last_check
        late = last is not None and now - last > LATE_CHECK_PERIODS * self.period_s
        if last is None or late or not busy or not self._was_busy or steps != self._last_steps:
            self.stalled_s = 0.0  # counted from the first check that finds it busy with no step since
        else:
            self.stalled_s += now - last
        self._last_check, self._last_steps, self._was_busy = now, steps, busy
        return self.stalled_s
