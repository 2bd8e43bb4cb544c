"""Per-tenant limits: the generic cell rate algorithm (GCRA), with a cost per request.

One number per tenant, the theoretical arrival time (TAT): when the tenant's
account would be back to full had it used exactly `rate` units per second. A
request costing `cost` units is allowed when, with it added, the account owes
no more than `burst` units (TAT + cost/rate - now <= burst/rate), and pushes
TAT on by cost/rate. Same behaviour as a bucket of `burst` units refilled at
`rate`/s, with O(1) state and no timer. Pure: the caller keeps the state and
the clock.

Two limits use it (gateway/ratelimit.py):
- the request rate: every request costs 1;
- the token budget: a request costs its prompt tokens at admission, and its
  output tokens, known only once it has finished, are added then (`charge`)
  whatever the account holds. That may leave the tenant in debt (TAT past
  now + burst/rate): its next request waits until the debt is paid off.

A request costing more than the whole burst would never fit. It is allowed
when the tenant owes nothing (TAT <= now), and its cost becomes debt: every
request can pass once its tenant has been idle long enough, and the sustained
rate still holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate_per_s: float  # sustained units (requests, tokens) per second; <= 0 disables the limit
    burst: float = 1  # units that may be used at once after an idle period

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    @property
    def horizon_s(self) -> float:
        """How far ahead of now the TAT may be after an allowed request: the burst, in seconds."""
        return max(1.0, self.burst) / self.rate_per_s


@dataclass(frozen=True)
class Decision:
    allowed: bool
    tat_s: float  # the tenant's new state
    retry_after_s: float  # when refused: how long until a request of the same cost would be allowed


def gcra(limit: RateLimit, tat_s: float | None, now_s: float, cost: float = 1.0) -> Decision:
    """Decide one request costing `cost` units of a tenant whose state is `tat_s` (None: never seen).
    A refusal leaves the state as it was: refused requests use nothing."""
    if not limit.enabled:
        return Decision(True, now_s, 0.0)
    tat = max(tat_s if tat_s is not None else now_s, now_s)
    after = tat + cost / limit.rate_per_s
    if tat <= now_s or after - now_s <= limit.horizon_s:  # owes nothing, or the request fits
        return Decision(True, after, 0.0)
    # Allowed again once it fits (TAT has come within horizon - cost) or, for a request larger
    # than the burst, once the tenant owes nothing: whichever comes first.
    wait = min(tat - now_s, after - limit.horizon_s - now_s)
    return Decision(False, tat_s if tat_s is not None else now_s, wait)


def charge(limit: RateLimit, tat_s: float | None, now_s: float, cost: float) -> float:
    """The state after `cost` more units were used, unconditionally: what a request used beyond
    what its admission could know (its output tokens). May leave the tenant in debt."""
    if not limit.enabled:
        return now_s
    return max(tat_s if tat_s is not None else now_s, now_s) + max(0.0, cost) / limit.rate_per_s


def refund(limit: RateLimit, tat_s: float | None, now_s: float, cost: float) -> float:
    """The state after giving back `cost` units of an admission whose request never ran (refused
    further on). Never beyond a full account: a TAT before now is the same as now."""
    if not limit.enabled or tat_s is None:
        return now_s
    return max(tat_s - max(0.0, cost) / limit.rate_per_s, now_s)


def token_budget(tokens_per_minute: int) -> RateLimit:
    """A budget of `tokens_per_minute` (prompt + output): a minute's worth may be used at once."""
    return RateLimit(tokens_per_minute / 60.0, burst=tokens_per_minute)
