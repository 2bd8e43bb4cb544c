"""Conditional disaggregation: should this prompt be prefilled on a prefill worker? Is its KV handle still good?"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DisaggPolicy:
    """`mode`: "disagg" (prefill pool, then decode pool) or "colocated" (decode pool only).

    In disagg mode a prompt is prefilled by the decode worker itself when it
    is shorter than `min_remote_prefill_tokens` (moving its KV costs more than
    it saves), unless that worker has prompts queued ahead of it and the
    prefill pool would give the first token sooner (admission control's model,
    `scheduler.admission.prefill_is_faster`): short prompts alone must not
    queue on the decode workers while the prefill pool idles. A longer prompt
    is prefilled by the decode worker when the prefill pool's backlog exceeds
    `max_prefill_backlog_tokens` (0 = no limit): waiting behind it would cost
    more than computing the prompt next to the decode (Dynamo's rule of thumb).
    """

    mode: str = "disagg"
    min_remote_prefill_tokens: int = 0
    max_prefill_backlog_tokens: int = 0


def route(policy: DisaggPolicy, prompt_tokens: int, prefill_backlog_tokens: int = 0,
          prefill_faster: Callable[[], bool] | None = None) -> str:
    """The path of one request: "disagg" or "colocated". `prefill_faster`: asked only for a prompt
    short enough for the decode worker; True sends it to the prefill pool instead."""
    if policy.mode == "colocated":
        return "colocated"
    if prompt_tokens < policy.min_remote_prefill_tokens:
        return "disagg" if prefill_faster is not None and prefill_faster() else "colocated"
    if policy.max_prefill_backlog_tokens and prefill_backlog_tokens > policy.max_prefill_backlog_tokens:
        return "colocated"
    return "disagg"


# A prefill engine keeps a prompt's KV blocks for `engine.kv_lease_s` for a decode engine to pull;
# a handle older than this share of the lease may point at blocks already reused.
KV_HANDLE_LIFE = 0.8


def handle_expired(age_ms: float, kv_lease_s: float) -> bool:
    """Is a KV handle `age_ms` after its prefill finished too old to pull (the decode worker then
    computes the prompt itself)? Older than `KV_HANDLE_LIFE` x the lease: reading reused blocks would
    silently produce wrong output, recomputing costs only time."""
    return age_ms > KV_HANDLE_LIFE * 1000 * kv_lease_s
