"""The tier streams of every stage an elastic worker consumes, claimed in one earliest-deadline-first order.

An elastic worker (scheduler/elastic.py) consumes the prefill and the decode
streams. Each stage keeps its own consumer group, retry lanes and affinity lanes
(`TierQueues`); this claims from them as one queue: the head that must start first
wins (its latest start, scheduler/edf.py), and of heads due together the decode
stage's (a stream already started finishes before a new prompt begins). It blocks
on the lanes of both stages at once, so an idle worker wakes for work of either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from skyline.core import messages
from skyline.core.streams import Claimed, Defer, Head, Take, TierQueues, defer_claim, now_ms
from skyline.scheduler.decode_room import paced_claim_due
from skyline.scheduler.edf import pick_tier, start_by_ms
from skyline.scheduler.elastic import STAGE_ORDER, stage_due_first


# (stage, head, its latest start in ms) -> does the claimer leave that head to its peers until it must
# start (elastic workers)?
Leave = Callable[[str, Head, int, bool], bool]  # (stage, head, its latest start, due now)


def stage_of_message(msg: messages.Message) -> str:
    """The stage whose streams carry `msg`: requests wait for a prefill, decode work for a decode."""
    return "decode" if isinstance(msg, messages.DecodeWork) else "prefill"


class StageQueues:
    def __init__(self, by_stage: dict[str, TierQueues]):
        self.by_stage = {s: by_stage[s] for s in STAGE_ORDER if s in by_stage}
        first = next(iter(self.by_stage.values()))
        self.r, self.keys, self.consumer = first.r, first.keys, first.consumer
        self.tier_names = first.tier_names
        self.left_heads = False  # the last `pick` passed over a head its `leave` left to peers

    def of(self, claimed: Claimed) -> TierQueues:
        return self.by_stage[stage_of_message(claimed.message)]

    async def peek_all(self, block_ms: int) -> list[tuple[str, Head]]:
        """(stage, head) of every tier of every stage with an entry this consumer may claim; waits up to
        `block_ms` for one to appear in any of them when there is none (0 = do not wait)."""
        heads = await self._peek(0)
        if heads or not block_ms:
            return heads
        lanes: dict[str, str] = {}
        bound = 0
        for q in self.by_stage.values():
            lanes.update(q.open_lanes)
            if q.deferred_until_ms:
                bound = min(bound or q.deferred_until_ms, q.deferred_until_ms)
        timeout = max(1, min(block_ms, bound - now_ms())) if bound else block_ms
        if await self.r.xread(lanes, count=1, block=timeout):
            return await self._peek(0)
        return await self._peek(0) if bound else []

    async def _peek(self, block_ms: int) -> list[tuple[str, Head]]:
        out = []
        for stage, q in self.by_stage.items():
            out += [(stage, h) for h in (await q.peek_heads(block_ms)).values()]
        return out

    def pick(self, heads: list[tuple[str, Head]], tiers: tuple[str, ...] | None = None, tokens_per_s: float = 0.0,
             due_by_ms: int | None = None, leave: Leave | None = None) -> tuple[str, Head] | None:
        """The head to claim: earliest latest start first over every stage (`start_by_ms` at the claimer's
        `tokens_per_s`, 0: by deadline; the tiers' EDF, `pick_tier`, within each stage), the decode stage
        first among equals (`stage_due_first`); among `tiers` only, if given; with `due_by_ms`, only if it
        must start by then; a head `leave(stage, head, its latest start, whether it must start now)` leaves to peers
        (`claiming.leaves_until_due`)."""
        now = now_ms() if leave is not None else 0
        self.left_heads = False
        first: dict[str, tuple[int, Head]] = {}  # stage -> (key, its head due first)
        for stage, head in heads:
            if tiers is not None and head.tier not in tiers:
                continue
            key = start_by_ms(head.deadline_ms, head.prefill_tokens, tokens_per_s)
            if leave is not None and leave(stage, head, key, paced_claim_due(key, now)):
                self.left_heads = True
                continue
            seen = first.get(stage)
            if seen is None or key < seen[0] or (
                    key == seen[0] and pick_tier({seen[1].tier: key, head.tier: key}, self.tier_names) == head.tier):
                first[stage] = (key, head)
        stage = stage_due_first({s: key for s, (key, _h) in first.items()})
        if stage is None or (due_by_ms is not None and not paced_claim_due(first[stage][0], due_by_ms)):
            return None
        return stage, first[stage][1]

    async def peek_heads(self, block_ms: int) -> dict[str, Head]:
        """tier -> its head due first over every stage (what a full worker's preemption check reads)."""
        out: dict[str, Head] = {}
        for _stage, head in await self.peek_all(block_ms):
            seen = out.get(head.tier)
            if seen is None or head.deadline_ms < seen.deadline_ms:
                out[head.tier] = head
        return out

    async def claim(self, block_ms: int = 1000, tiers: tuple[str, ...] | None = None,
                    take: Take | None = None, defer: Defer | None = None,
                    wake: asyncio.Event | None = None, tokens_per_s: float = 0.0,
                    due_by_ms: int | None = None, leave: Leave | None = None) -> Claimed | None:
        """Claim the head due first over every stage (`take`: for the decode stage's entries; `defer`,
        `wake`, `tokens_per_s` and `due_by_ms`: as `TierQueues.claim`'s; `leave`: as `pick`'s)."""
        chosen = self.pick(await self.peek_all(block_ms), tiers, tokens_per_s, due_by_ms, leave)
        if chosen is not None and defer is not None and (wait := defer(chosen[1])) > 0:
            await defer_claim(wait, wake)
            chosen = self.pick(await self.peek_all(0), tiers, tokens_per_s, due_by_ms, leave)
        if chosen is None:
            return None
        stage, head = chosen
        return await self.by_stage[stage].claim_head(head, take if stage == "decode" else None)

    async def ack(self, claimed: Claimed) -> bool:
        return await self.of(claimed).ack(claimed)

    async def release_prefill(self, claimed: Claimed) -> None:
        await self.of(claimed).release_prefill(claimed)
