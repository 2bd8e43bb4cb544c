"""Per-API-key rate limits in the gateway (policy: scheduler/rate_limit.py).

State lives in this gateway process: each of N gateways behind a load
balancer enforces the limit on what it sees, so a tenant's fleet-wide limit
is up to N times the configured one. Bounded: the least recently seen
tenants are forgotten beyond `max_tenants` (a forgotten tenant starts with a
full burst again, which errs on the side of serving).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict

from skyline.gateway.errors import ApiError
from skyline.scheduler.rate_limit import RateLimit, gcra


class KeyRateLimiter:
    def __init__(self, limit: RateLimit, max_tenants: int = 100_000, clock=time.monotonic):
        self.limit = limit
        self.max_tenants = max_tenants
        self.clock = clock
        self._tat: OrderedDict[bytes, float] = OrderedDict()
        self.refused = 0

    def check(self, api_key: str | None) -> None:
        """Raise 429 with Retry-After when the key's tenant is over its rate."""
        if not self.limit.enabled or not api_key:
            return
        tenant = hashlib.sha256(api_key.encode()).digest()[:16]  # never keep the key itself
        d = gcra(self.limit, self._tat.get(tenant), self.clock())
        self._tat[tenant] = d.tat_s
        self._tat.move_to_end(tenant)
        if len(self._tat) > self.max_tenants:
            self._tat.popitem(last=False)
        if not d.allowed:
            self.refused += 1
            raise ApiError(429, f"rate limit of {self.limit.rate_per_s:g} requests/s (burst {self.limit.burst}) "
                                f"for this API key exceeded; retry after {d.retry_after_s:.2f} s",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, math.ceil(d.retry_after_s)))})
