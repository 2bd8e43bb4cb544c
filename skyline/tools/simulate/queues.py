"""The tier streams of one stage, in memory: FIFO per tier, EDF across tiers, and the backlog counters.

Mirrors `skyline.core.streams.TierQueues` and the `skyline:backlog` hash: a worker
compares the heads of the tier queues by their latest start at its prefill rate
(`scheduler.edf.start_by_ms`; `rate` 0: by deadline) and claims from the one that
`scheduler.edf.pick_tier` names. New entries go to the tail; a preempted
request goes to its tier's retry lane with its original deadline (as the
live worker re-XADDs it to `skyline:{stage}:<tier>:retry`), and a tier's head
is the earlier-due of its queue's and its retry lane's (a tie, to the ms, goes
to the retry lane: `scheduler.edf.retry_first`). Work that still needs its prompt computed adds its prompt
tokens to the stage's backlog when enqueued (or when admission reserved
them) and removes them when acked.

Affinity lanes (`push_placed`, `claim_as`): work the gateway placed for one
worker's prefix cache, per worker and tier, as the live `skyline:{stage}:<tier>:@<worker>`
streams. Their head counts among a tier's heads for that worker, and for any
other once its bound has passed (`scheduler.prefix.may_claim`); among one
tier's lanes the earliest deadline wins, a tie going to the lane read first
(the stream, its retry lane, then the affinity lanes by worker), as
`TierQueues.heads_of` picks. Without placed work (`placed_size` 0) none of
this runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from skyline.scheduler.edf import pick_tier, retry_first, start_by_ms
from skyline.scheduler.prefix import may_claim
from skyline.tools.simulate.request import SimRequest

# (an entry, its latest start in ms) -> does the claimer leave it to its peers until it must start (live:
# `stage_queues.Leave`)?
Skip = Callable[[tuple, int, bool], bool]  # (entry, its latest start, due now)


class StageQueues:
    __slots__ = ("backlog", "deferring", "placed", "placed_size", "queues", "retry", "retry_size", "size", "stage",
                 "tier_order")

    def __init__(self, stage: str, tier_order: tuple[str, ...]):
        self.stage = stage
        self.tier_order = tier_order  # strictest first: EDF ties go to it
        self.queues: dict[str, deque] = {t: deque() for t in tier_order}
        self.retry: dict[str, deque] = {t: deque() for t in tier_order}  # work returned to the queue
        self.backlog: dict[str, int] = {t: 0 for t in tier_order}  # prompt tokens admitted, not yet prefilled
        self.size = 0  # entries waiting, affinity lanes included
        self.retry_size = 0
        # worker -> tier -> its affinity lane, for the workers with placed work waiting (by worker name)
        self.placed: dict[str, dict[str, deque]] = {}
        self.placed_size = 0  # entries in affinity lanes
        # Workers waiting out a claim defer (scheduler.claiming.claim_defer_s) before claiming from here:
        # each claims an entry when it wakes, so the fleet wakes no other waiting worker for that many.
        self.deferring = 0

    def push(self, req: SimRequest, item) -> None:
        self.queues[req.tier].append(item)
        self.size += 1

    def push_retry(self, req: SimRequest, item) -> None:
        """A preempted request, back with its original deadline: ahead of its tier's newer entries."""
        self.retry[req.tier].append(item)
        self.size += 1
        self.retry_size += 1

    def _lane(self, tier: str) -> deque | None:
        """The queue holding `tier`'s next entry (None when the tier has none): `scheduler.edf.retry_first`
        on the two heads' deadlines in ms, as the live worker sees them in the streams."""
        main, retry = self.queues[tier], self.retry[tier]
        if not retry:
            return main or None
        if main and not retry_first(int(retry[0][0].deadline * 1000), int(main[0][0].deadline * 1000)):
            return main
        return retry

    def heads(self, rate: float = 0.0) -> dict[str, int]:
        """Latest start (ms) of each non-empty tier's head at prefill rate `rate` (0: its deadline), as a
        worker's peek sees them."""
        out = {}
        for t in self.tier_order:
            lane = self._lane(t)
            if lane is not None:
                out[t] = start_key(lane[0], int(lane[0][0].deadline * 1000), rate)
        return out

    def head(self):
        """The entry EDF serves next from the shared streams by deadline, without claiming it (None when empty):
        what the fleet-level preemption check reads (live: `WorkerRuntime._maybe_preempt`)."""
        if self.size == self.placed_size:
            return None
        return self._lane(pick_tier(self.heads(), self.tier_order))[0]

    def push_placed(self, req: SimRequest, item, worker: str) -> None:
        """An entry placed for `worker` (its affinity lane of the request's tier)."""
        lanes = self.placed.get(worker)
        if lanes is None:
            self.placed[worker] = {t: deque() for t in self.tier_order}
            self.placed = dict(sorted(self.placed.items()))  # read in the live consumer's order
            lanes = self.placed[worker]
        lanes[req.tier].append(item)
        self.size += 1
        self.placed_size += 1

    def claimable(self, me: str, now_ms: int) -> bool:
        """Is any entry waiting that worker `me` may claim now?"""
        if self.size > self.placed_size:
            return True
        for worker, lanes in self.placed.items():
            for lane in lanes.values():
                if lane and may_claim(me, worker, now_ms, lane[0][0].until_ms, True):
                    return True
        return False

    def _choose(self, me: str, now_ms: int, max_rank: int | None, rate: float = 0.0,
                skip: Skip | None = None) -> tuple | None:
        """(lane, holder or None, latest start ms at prefill rate `rate`) of the EDF head among the entries
        worker `me` may claim (its own lanes, the shared streams, others' lanes past their bound), or None;
        a tier's head that `skip` leaves to peers, told whether it must start now (live: `StageQueues.pick`)."""
        tiers = self.tier_order if max_rank is None else self.tier_order[: max_rank + 1]
        heads: dict[str, int] = {}
        chosen: dict[str, tuple] = {}
        for t in tiers:
            best, due, holder = None, 0, None
            main, retry = self.queues[t], self.retry[t]
            if main:
                best, due = main, int(main[0][0].deadline * 1000)
            if retry:
                d = int(retry[0][0].deadline * 1000)
                if best is None or retry_first(d, due):
                    best, due = retry, d
            for worker, lanes in self.placed.items():
                lane = lanes[t]
                if lane and may_claim(me, worker, now_ms, lane[0][0].until_ms, True):
                    d = int(lane[0][0].deadline * 1000)
                    if best is None or not retry_first(due, d):  # earlier than the head so far; a tie keeps it
                        best, due, holder = lane, d, worker
            if best is not None:
                key = start_key(best[0], due, rate)
                if skip is not None and skip(best[0], key, key <= now_ms):
                    continue
                heads[t], chosen[t] = key, (best, holder, key)
        if not heads:
            return None
        return chosen[pick_tier(heads, self.tier_order)]  # type: ignore[index]

    def due_for(self, me: str, now_ms: int, max_rank: int | None = None, rate: float = 0.0,
                skip: Skip | None = None) -> int | None:
        """The latest start (ms, at prefill rate `rate`) of the entry `claim_as` would give worker `me`, None
        when none: what an elastic worker compares across its two stages (scheduler.elastic.stage_due_first)
        and a paced-out worker against the clock (scheduler.decode_room.paced_claim_due)."""
        if not self.size:
            return None
        chosen = self._choose(me, now_ms, max_rank, rate, skip)
        return None if chosen is None else chosen[2]

    def peek_as(self, me: str, now_ms: int, max_rank: int | None = None, rate: float = 0.0,
                skip: Skip | None = None):
        """The entry `claim_as` would give worker `me`, left where it is (None when none)."""
        chosen = self._choose(me, now_ms, max_rank, rate, skip)
        return None if chosen is None else chosen[0][0]

    def peek(self, max_rank: int | None = None, rate: float = 0.0):
        """The entry `claim` would take, left where it is (None when none)."""
        if self.size == self.placed_size:
            return None
        if not self.retry_size and max_rank is None:
            only = None
            for q in self.queues.values():
                if q:
                    if only is not None:  # several tiers waiting: the EDF policy chooses
                        return self.queues[pick_tier(self.heads(rate), self.tier_order)][0]  # type: ignore[index]
                    only = q
            return None if only is None else only[0]  # one tier waiting: `claim`'s hot path
        heads = self.heads(rate)
        if max_rank is not None:
            allowed = self.tier_order[: max_rank + 1]
            heads = {t: d for t, d in heads.items() if t in allowed}
        if not heads:
            return None
        return self._lane(pick_tier(heads, self.tier_order))[0]  # type: ignore[arg-type, index]

    def claim_as(self, me: str, now_ms: int, max_rank: int | None = None, rate: float = 0.0,
                 skip: Skip | None = None):
        """`claim` with affinity lanes: the EDF head among those worker `me` may claim (its own lanes,
        the shared streams, others' lanes past their bound), or None; `skip`: as `_choose`'s."""
        chosen = self._choose(me, now_ms, max_rank, rate, skip)
        if chosen is None:
            return None
        lane, holder, _due = chosen
        item = lane.popleft()
        self.size -= 1
        if holder is not None:
            self.placed_size -= 1
            if not any(self.placed[holder].values()):
                del self.placed[holder]  # only workers with placed work are looked at
        elif lane is self.retry[item[0].tier]:
            self.retry_size -= 1
        return item

    def claim(self, max_rank: int | None = None, rate: float = 0.0):
        """Take the entry EDF serves next by latest start at prefill rate `rate` (None when empty), among the
        tiers of rank <= `max_rank` if given."""
        if not self.size:
            return None
        if self.retry_size or max_rank is not None:
            heads = self.heads(rate)
            if max_rank is not None:
                allowed = self.tier_order[: max_rank + 1]
                heads = {t: d for t, d in heads.items() if t in allowed}
            if not heads:
                return None
            lane = self._lane(pick_tier(heads, self.tier_order))  # type: ignore[arg-type]
            self.size -= 1
            if lane is not self.queues[lane[0][0].tier]:  # type: ignore[index]
                self.retry_size -= 1
            return lane.popleft()  # type: ignore[union-attr]
        self.size -= 1
        only = None
        for q in self.queues.values():
            if q:
                if only is not None:  # several tiers waiting: the EDF policy chooses
                    return self.queues[pick_tier(self.heads(rate), self.tier_order)].popleft()  # type: ignore[index]
                only = q
        # One tier waiting: pick_tier would name it (the hot path of a big fleet).
        return only.popleft()  # type: ignore[union-attr]

    def reserve(self, tier: str, tokens: int) -> None:
        self.backlog[tier] += tokens

    def release(self, tier: str, tokens: int) -> None:
        self.backlog[tier] -= tokens


def start_key(item: tuple, deadline_ms: int, rate: float) -> int:
    """The latest start (ms) of entry `item` due at `deadline_ms` at prefill rate `rate` (`start_by_ms`): an
    entry with a KV handle (`item[1]` set) has no prompt to compute, the rest their uncached tokens (the live
    entry's `prefill_tokens`)."""
    return start_by_ms(deadline_ms, item[0].backlog_tokens if item[1] is None else 0, rate)
