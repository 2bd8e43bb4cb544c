"""Per-API-key limits in the gateway: request rate and token budget (policy: scheduler/rate_limit.py).

State lives in this gateway process, for both: each of N gateways behind a load
balancer enforces the limits on what it sees, so a tenant's fleet-wide limit is
up to N times the configured one (a balancer that routes by API key keeps it
exact). Chosen over a shared count in Redis so that a limit costs the hot path
no round trip; a fleet-wide budget would need one per request (or a lease
scheme) and would fail open or closed with Redis. Bounded: the least recently
seen tenants are forgotten beyond `max_tenants` (a forgotten tenant starts with
a full burst again, debt forgiven, which errs on the side of serving).

The token budget (`TokenBudgets`) counts prompt + output tokens per minute: a
request is admitted on its prompt tokens once vLLM has rendered it (they are
known only then), given back if the fleet refuses it before it runs, and its
output tokens are added when it ends. A key in debt is refused at the door,
before its body is read or rendered, so a flooding tenant costs little.
Requests running at once each fit the budget on their prompt; their outputs
can still overshoot it, and that debt delays the key's next requests.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from skyline.gateway.errors import ApiError
from skyline.scheduler.rate_limit import RateLimit, charge, gcra, refund, token_budget


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
                           headers={"Retry-After": _seconds(d.retry_after_s)})


class TokenBudgets:
    """Every tenant's token budget in this process, by owner digest (gateway/tenants.py)."""

    def __init__(self, max_tenants: int = 100_000, clock=time.monotonic):
        self.max_tenants = max_tenants
        self.clock = clock
        self._tat: OrderedDict[str, float] = OrderedDict()

    def check(self, owner: str, tokens_per_minute: int) -> None:
        """At the door: 429 when the tenant is in debt (even a request of no tokens would wait)."""
        if tokens_per_minute > 0 and owner in self._tat:
            self._decide(owner, tokens_per_minute, 0, commit=False)

    def admit(self, owner: str, tokens_per_minute: int, prompt_tokens: int) -> TokenCharge | None:
        """Admit a request of `prompt_tokens`, or raise 429; what it was charged, to settle at its end."""
        if tokens_per_minute <= 0:
            return None
        self._decide(owner, tokens_per_minute, prompt_tokens, commit=True)
        return TokenCharge(self, owner, tokens_per_minute, prompt_tokens)

    def _decide(self, owner: str, tokens_per_minute: int, tokens: int, commit: bool) -> None:
        limit = token_budget(tokens_per_minute)
        d = gcra(limit, self._tat.get(owner), self.clock(), cost=tokens)
        if not d.allowed:
            raise ApiError(429, f"token budget of {tokens_per_minute} tokens per minute (prompt + output) for this "
                                f"API key exceeded; retry after {d.retry_after_s:.1f} s",
                           type="rate_limit_error", code="token_budget_exceeded",
                           headers={"Retry-After": _seconds(d.retry_after_s)})
        if commit:
            self._store(owner, d.tat_s)

    def _store(self, owner: str, tat_s: float) -> None:
        self._tat[owner] = tat_s
        self._tat.move_to_end(owner)
        if len(self._tat) > self.max_tenants:
            self._tat.popitem(last=False)

    def adjust(self, owner: str, tokens_per_minute: int, tokens: int,
               rule: Callable[[RateLimit, float | None, float, float], float]) -> None:
        """Apply `charge` or `refund` of scheduler/rate_limit.py to the tenant's state."""
        self._store(owner, rule(token_budget(tokens_per_minute), self._tat.get(owner), self.clock(), tokens))


class TokenCharge:
    """One admitted prompt: given back if the fleet never ran it, else completed by its output."""

    def __init__(self, budgets: TokenBudgets, owner: str, tokens_per_minute: int, prompt_tokens: int):
        self.budgets, self.owner, self.tokens_per_minute, self.prompt_tokens = (
            budgets, owner, tokens_per_minute, prompt_tokens)

    def refund(self) -> None:
        """The request was refused after admission (admission control, no workers, Redis down)."""
        self.budgets.adjust(self.owner, self.tokens_per_minute, self.prompt_tokens, refund)

    def settle(self, session: Any, status: int, fin: Any) -> None:
        """Session.close hook: charge the output tokens it produced (those sent before a failure or
        a disconnect too: they were computed)."""
        output = (fin.completion_tokens if fin is not None else 0) or session.tokens
        if output:
            self.budgets.adjust(self.owner, self.tokens_per_minute, output, charge)


def _seconds(wait_s: float) -> str:
    """A Retry-After value: whole seconds, at least 1 (a client that retries at 0 is refused again)."""
    return str(max(1, math.ceil(wait_s)))
