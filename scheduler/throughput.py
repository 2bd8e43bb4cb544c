"""Measured prefill throughput: prompt tokens per second of busy time.

A worker runs several prefills at once, so tokens / (end - start) of one
request understates its rate. The meter keeps recent (start, end, tokens)
intervals and divides the tokens by the length of the *union* of the
intervals: the time the engine actually had prefill work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class ThroughputMeter:
    window_ms: int = 30_000  # forget work that ended longer ago than this
    max_samples: int = 256
    _samples: deque[tuple[int, int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self._samples = deque(maxlen=self.max_samples)  # the oldest sample drops out as a new one comes

    def record(self, start_ms: int, end_ms: int, tokens: int) -> None:
        if end_ms <= start_ms or tokens <= 0:
            return
        self._samples.append((start_ms, end_ms, tokens))

    def tokens_per_s(self, now_ms: int) -> float | None:
        """Tokens per busy second over the window; None before any measurement."""
        cutoff = now_ms - self.window_ms
        recent = sorted([x for x in self._samples if x[1] >= cutoff])  # by start: (start, end, tokens)
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


def rate_or_prior(measured: float | None, prior: float) -> float:
    """The prefill rate a worker plans with (preemption): what its meter measured, else the prior
    (`worker.prior_prefill_tokens_per_s`) until it has measured any."""
    return measured or prior
