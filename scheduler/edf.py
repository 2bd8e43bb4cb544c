"""Earliest-deadline-first choice among the heads of the tier streams, by latest start.

A head is served by when its prompt must start to meet its TTFT deadline
(`start_by_ms`: the deadline less the time its prompt takes to compute), not by
the deadline alone. Measured on the mixed chat + RAG benchmark (574 ms chat,
7.1 s RAG targets, one-core engines): ordered by deadline, a 1,500-token RAG
prompt (~4.5 s of compute) came after every chat that arrived up to 6.5 s after
it and waited 8-13 s in the queue; by latest start it comes before the chats
that arrive more than ~2.5 s after it. For work of equal size the two orders
are the same, and a head's key never exceeds its deadline, so nothing starves
that deadline order would not starve.
"""

from __future__ import annotations

from collections.abc import Mapping


def start_by_ms(deadline_ms: int, prefill_tokens: int, tokens_per_s: float) -> int:
    """The latest time (ms) the prompt of a head due at `deadline_ms` can start and still get its first
    token by then: `prefill_tokens` (what its claimer computes; 0 for a KV hand-off) at `tokens_per_s` (the
    claiming worker's measured prompt rate) before the deadline. No rate: the deadline."""
    if prefill_tokens <= 0 or tokens_per_s <= 0:
        return deadline_ms
    return deadline_ms - int(1000 * prefill_tokens / tokens_per_s)


def pick_tier(head_deadlines_ms: Mapping[str, int], tier_order: tuple[str, ...]) -> str | None:
    """The tier whose oldest waiting request is due first: `head_deadlines_ms` maps each tier with work
    waiting to its head's key, its deadline or its latest start (`start_by_ms`).

    Each tier stream is FIFO and all its requests share (or tighten) one TTFT
    target, so its head has the tier's earliest deadline; EDF over the heads
    is EDF over everything queued. Ties go to the tier listed first in
    `tier_order` (the stricter one). Returns None when nothing is waiting.
    """
    if not head_deadlines_ms:
        return None
    rank = {name: i for i, name in enumerate(tier_order)}
    return min(head_deadlines_ms, key=lambda t: (head_deadlines_ms[t], rank.get(t, len(rank))))


def retry_first(retry_deadline_ms: int, stream_deadline_ms: int) -> bool:
    """Of one tier's two lanes (its stream and its retry lane, where work returned to the queue goes
    back with its original deadline), is the retry lane's head served first? The earlier deadline;
    a tie goes to the retry lane (its entry arrived first)."""
    return retry_deadline_ms <= stream_deadline_ms
