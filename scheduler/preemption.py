"""Fleet-level preemption: abort a running low-tier prefill for a request that would be late.

vLLM's own priority scheduling does not help a waiting high-priority prompt
while lower-priority prompts already hold the step's token budget (measured:
a short request behind six ~1,500-token prompts waited 8.6-9 s with
`--scheduling-policy priority`). So the prefill worker holds few prompts at a
time, and when the head of a stricter tier would miss its deadline waiting
for them, the least urgent ones are aborted and re-queued with their original
arrival times (same deadlines: EDF brings them back in turn).

Starvation is bounded twice: a request is preempted at most
`max_preemptions` times, and its deadline keeps its place in EDF order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Running:
    request_id: str
    tier_rank: int  # 0 = strictest tier
    deadline_ms: int
    remaining_tokens: int  # prompt tokens still to prefill (estimate)
    preemptions: int  # times this request was already preempted


@dataclass(frozen=True)
class Waiting:
    tier_rank: int
    deadline_ms: int
    prompt_tokens: int


@dataclass(frozen=True)
class PreemptionPolicy:
    enabled: bool = True
    max_preemptions: int = 2


def choose_victims(
    policy: PreemptionPolicy, running: list[Running], head: Waiting, now_ms: int, tokens_per_s: float
) -> list[str]:
    """The requests to abort so that `head` can meet its deadline, least urgent first.

    vLLM keeps giving each step's token budget to requests already running
    before it looks at a waiting one, whatever their priorities, so every
    running prompt delays `head` by all of its remaining work. Preempt only
    when `head` would miss its deadline waiting for them, and then abort
    looser-tier requests (loosest tier, then latest deadline, then most
    remaining work: the least sunk cost) until what is left fits before the
    deadline. Requests of `head`'s tier or stricter, and requests that have
    used up their preemptions, are never chosen.
    """
    if not policy.enabled or not running or tokens_per_s <= 0:
        return []
    budget_tokens = (head.deadline_ms - now_ms) * tokens_per_s / 1000.0 - head.prompt_tokens
    ahead = sum(r.remaining_tokens for r in running)
    if ahead <= budget_tokens:
        return []
    candidates = sorted(
        (r for r in running if r.tier_rank > head.tier_rank and r.preemptions < policy.max_preemptions),
        key=lambda r: (r.tier_rank, r.deadline_ms, r.remaining_tokens),
        reverse=True,
    )
    victims = []
    for r in candidates:
        if ahead <= budget_tokens:
            break
        victims.append(r.request_id)
        ahead -= r.remaining_tokens
    return victims
