"""The tier streams of one stage, in memory: FIFO per tier, EDF across tiers, and the backlog counters.

Mirrors `skyline.streams.TierQueues` and the `skyline:backlog` hash: a worker
compares the heads of the tier queues and claims from the one that
`scheduler.edf.pick_tier` names. Entries go to the tail (a preempted request
too, with its original deadline, as the live worker re-XADDs it). Work that
still needs its prompt computed adds its prompt tokens to the stage's
backlog when enqueued (or when admission reserved them) and removes them
when acked.
"""

from __future__ import annotations

from collections import deque

from skyline.scheduler.edf import pick_tier
from skyline.simulate.request import SimRequest


class StageQueues:
    __slots__ = ("backlog", "queues", "size", "stage", "tier_order")

    def __init__(self, stage: str, tier_order: tuple[str, ...]):
        self.stage = stage
        self.tier_order = tier_order  # strictest first: EDF ties go to it
        self.queues: dict[str, deque] = {t: deque() for t in tier_order}
        self.backlog: dict[str, int] = {t: 0 for t in tier_order}  # prompt tokens admitted, not yet prefilled
        self.size = 0

    def push(self, req: SimRequest, item) -> None:
        self.queues[req.tier].append(item)
        self.size += 1

    def heads(self) -> dict[str, int]:
        """Deadline (ms) of each non-empty tier's head, as a worker's peek sees them."""
        out = {}
        for t, q in self.queues.items():
            if q:
                out[t] = int(q[0][0].deadline * 1000)
        return out

    def head(self):
        """The entry EDF serves next, without claiming it (None when empty)."""
        if not self.size:
            return None
        return self.queues[pick_tier(self.heads(), self.tier_order)][0]

    def claim(self, max_rank: int | None = None):
        """Take the entry EDF serves next (None when empty), among the tiers of rank <= `max_rank` if given."""
        if not self.size:
            return None
        if max_rank is not None:
            heads = {t: int(self.queues[t][0][0].deadline * 1000) for t in self.tier_order[: max_rank + 1]
                     if self.queues[t]}
            if not heads:
                return None
            self.size -= 1
            return self.queues[pick_tier(heads, self.tier_order)].popleft()
        self.size -= 1
        only = None
        for q in self.queues.values():
            if q:
                if only is not None:  # several tiers waiting: the EDF policy chooses
                    return self.queues[pick_tier(self.heads(), self.tier_order)].popleft()
                only = q
        return only.popleft()  # one tier waiting: pick_tier would name it (the hot path of a big fleet)

    def reserve(self, tier: str, tokens: int) -> None:
        self.backlog[tier] += tokens

    def release(self, tier: str, tokens: int) -> None:
        self.backlog[tier] -= tokens
