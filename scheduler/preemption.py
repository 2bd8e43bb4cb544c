"""Fleet-level preemption: abort a running low-tier prefill for a request that would be late.

vLLM's own priority scheduling does not help a waiting high-priority prompt
while lower-priority prompts already hold the step's token budget (measured:
a short request behind six ~1,500-token prompts waited 8.6-9 s with
`--scheduling-policy priority`). So the prefill worker holds few prompts at a
time, and when the head of a stricter tier would miss its deadline waiting
for them, the least urgent one is aborted and re-queued with its original
arrival time (same deadline: EDF brings it back in turn).

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


def choose_victim(
    policy: PreemptionPolicy, running: list[Running], head: Waiting, now_ms: int, tokens_per_s: float
) -> str | None:
    """The request to abort so `head` can start now, or None.

    Preempt only when `head` would miss its deadline if it waited for the
    running work to finish, and a victim of a strictly looser tier exists that
    has not used up its preemptions. Among candidates: the loosest tier, then the
    latest deadline, then the most remaining work (the least sunk cost).
    """
    if not policy.enabled or not running or tokens_per_s <= 0:
        return None
    ms_per_token = 1000.0 / tokens_per_s
    finish_if_waiting = now_ms + (sum(r.remaining_tokens for r in running) + head.prompt_tokens) * ms_per_token
    if finish_if_waiting <= head.deadline_ms:
        return None
    candidates = [r for r in running if r.tier_rank > head.tier_rank and r.preemptions < policy.max_preemptions]
    if not candidates:
        return None
    victim = max(candidates, key=lambda r: (r.tier_rank, r.deadline_ms, r.remaining_tokens))
    return victim.request_id
