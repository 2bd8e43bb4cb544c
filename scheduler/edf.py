"""Earliest-deadline-first choice among the heads of the tier streams."""

from __future__ import annotations

from collections.abc import Mapping


def pick_tier(head_deadlines_ms: Mapping[str, int], tier_order: tuple[str, ...]) -> str | None:
    """The tier whose oldest waiting request has the earliest deadline.

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
