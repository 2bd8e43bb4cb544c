"""Per-tenant request rate limits: the generic cell rate algorithm (GCRA).

One number per tenant, the theoretical arrival time (TAT) of its next request
if it sent at exactly `rate`: a request is allowed when it arrives no earlier
than TAT minus the burst allowance, and pushes TAT one emission interval on.
Same behaviour as a token bucket of `burst` tokens refilled at `rate`/s, with
O(1) state and no timer. Pure: the caller keeps the state and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate_per_s: float  # sustained requests per second; <= 0 disables the limit
    burst: int = 1  # requests that may arrive at once after an idle period

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0


@dataclass(frozen=True)
class Decision:
    allowed: bool
    tat_s: float  # the tenant's new state
    retry_after_s: float  # when refused: how long until one request would be allowed


def gcra(limit: RateLimit, tat_s: float | None, now_s: float) -> Decision:
    """Decide one request of a tenant whose state is `tat_s` (None: never seen)."""
    if not limit.enabled:
        return Decision(True, now_s, 0.0)
    interval = 1.0 / limit.rate_per_s
    tolerance = interval * (max(1, limit.burst) - 1)
    tat = max(tat_s if tat_s is not None else now_s, now_s)
    if tat - tolerance > now_s:
        return Decision(False, tat_s if tat_s is not None else now_s, tat - tolerance - now_s)
    return Decision(True, tat + interval, 0.0)
