"""Conditional disaggregation: should this prompt be prefilled on a prefill worker?"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DisaggPolicy:
    """`mode`: "disagg" (prefill pool, then decode pool) or "colocated" (decode pool only).

    `min_remote_prefill_tokens`: in disagg mode, prompts shorter than this are
    prefilled by the decode worker itself, because moving their KV costs more
    than it saves (0 = every prompt goes to the prefill pool).
    """

    mode: str = "disagg"
    min_remote_prefill_tokens: int = 0


def route(policy: DisaggPolicy, prompt_tokens: int) -> str:
    """The path of one request: "disagg" or "colocated"."""
    if policy.mode == "colocated" or prompt_tokens < policy.min_remote_prefill_tokens:
        return "colocated"
    return "disagg"
