"""Measured prefill throughput: prompt tokens per second of busy time.

A worker runs several prefills at once, so tokens / (end - start) of one
request understates its rate. The meter keeps recent (start, end, tokens)
intervals and divides the tokens by the length of the *union* of the
intervals: the time the engine actually had prefill work.

The answer is kept until it can change: a new sample, or the oldest sample
it counts leaving the window (admission control and placement read a
worker's rate for every request; a simulated fleet of hundreds of workers
would otherwise sort 256 samples at every read).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class ThroughputMeter:
    window_ms: int = 30_000  # forget work that ended longer ago than this
    max_samples: int = 256
    _samples: deque[tuple[int, int, int]] = field(init=False)
    # The last answer, and the times it holds between: from when it was measured until the oldest
    # sample it counts leaves the window (`_kept` is False from the next sample on).
    _rate: float | None = field(init=False)
    _kept: bool = field(init=False)
    _kept_from: int = field(init=False)
    _kept_until: int = field(init=False)

    def __post_init__(self) -> None:
        self._samples = deque(maxlen=self.max_samples)  # the oldest sample drops out as a new one comes
        # (set here, not as the fields' defaults: mypyc's compiled dataclass leaves those unset)
        self._rate, self._kept, self._kept_from, self._kept_until = None, False, 0, 0

    def record(self, start_ms: int, end_ms: int, tokens: int) -> None:
        if end_ms <= start_ms or tokens <= 0:
            return
        self._samples.append((start_ms, end_ms, tokens))
        self._kept = False

    def tokens_per_s(self, now_ms: int) -> float | None:
        """Tokens per busy second over the window; None before any measurement."""
        if self._kept and self._kept_from <= now_ms <= self._kept_until:
            return self._rate
        cutoff = now_ms - self.window_ms
        recent = sorted([x for x in self._samples if x[1] >= cutoff])  # by start: (start, end, tokens)
        self._kept, self._kept_from = True, now_ms
        # A sample counts while now - window <= its end: the answer holds until the earliest end leaves.
        self._kept_until = min([x[1] for x in recent]) + self.window_ms if recent else _NEVER
        self._rate = self._measure(recent)
        return self._rate

    @staticmethod
    def _measure(recent: list[tuple[int, int, int]]) -> float | None:
        """Tokens per busy second of `recent` (sorted by start); None for none."""
        if not recent:
            return None
        busy_ms = 0
        cur_s, cur_e = recent[0][0], recent[0][1]
        for s, e, _t in recent[1:]:
            if s > cur_e:
                busy_ms += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy_ms += cur_e - cur_s
        return sum([x[2] for x in recent]) * 1000.0 / busy_ms


_NEVER = 2**62  # (a time no clock reaches: an answer that holds until the next sample)


def rate_or_prior(measured: float | None, prior: float) -> float:
    """The prefill rate a worker plans with (preemption): what its meter measured, else the prior
    (`worker.prior_prefill_tokens_per_s`) until it has measured any."""
    return measured or prior
