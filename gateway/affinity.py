"""Prefix affinity in the gateway: what each engine holds of a prompt, and where to place it.

The policy and the decision are scheduler/prefix.py's (`CacheMatch`, `choose`,
`PlacedInFlight`: pure, shared with the simulator's gateway); this module
gathers what they decide on: the live workers (the fleet view's heartbeats:
role, load, block size) and how many leading blocks of the prompt each one's
engine holds (the cache view in Redis, read for every worker of both stages in
the same round trip as admission control's backlog). Skipped, at no cost,
when no live worker reports a prefix cache or the prompt is shorter than a block.

What it is used for (gateway/dispatch.py):
- the route: a prompt whose decode worker already holds most of it (the next
  turn of a conversation) skips the prefill pool, as a short prompt does
  (conditional disaggregation counts the tokens left to compute);
- admission control counts those same uncached tokens;
- the placement: with two or more workers of the request's stage, the one to
  wait for (its affinity lane, `skyline.core.streams.Placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from skyline.core import cache_view
from skyline.core.fleet import WorkerInfo
from skyline.core.keys import Keys
from skyline.core.messages import GenerateRequest
from skyline.core.streams import Placement, now_ms
from skyline.scheduler.prefix import (  # noqa: F401 - CacheMatch, PlacedInFlight, overloaded: the gateway's names
    AffinityPolicy, CacheMatch, PlacedInFlight, block_chain, choose, overloaded,
)


@dataclass(frozen=True)
class LookUp:
    """The cache-view reads for one prompt, to be sent in the gateway's one round trip before the
    enqueue (gateway/dispatch.py puts them on the pipeline that also reserves the backlog)."""

    prompt_tokens: int
    block_size: int
    chain: tuple[str, ...]  # the prompt's block hashes (empty: shorter than a block)
    workers: tuple[WorkerInfo, ...]  # those reporting a cache of `block_size`

    def queue(self, pipe, keys: Keys) -> int:
        """Put the reads on `pipe`; returns how many replies they take."""
        return cache_view.queue_match(pipe, keys, [w.worker_id for w in self.workers], self.chain)

    def result(self, replies) -> CacheMatch:
        ids = [w.worker_id for w in self.workers]
        return CacheMatch(self.prompt_tokens, self.block_size, cache_view.parse_match(ids, self.chain, replies),
                          self.workers)


def look_up(workers: list[WorkerInfo], req: GenerateRequest, max_blocks: int) -> LookUp | None:
    """What to read to learn how much of the request's prompt each live worker's engine holds
    (None: no worker reports a cache, nothing to read)."""
    reporting = [w for w in workers if w.cache_block_size]
    if not reporting or req.adapter is not None:  # no view holds blocks computed with an adapter (vllm_kv_events.py)
        return None
    block_size = reporting[0].cache_block_size  # one model, one block size; others are not comparable
    reporting = [w for w in reporting if w.cache_block_size == block_size]
    chain = block_chain(req.prompt_token_ids, block_size, max_blocks, req.cache_salt or "")
    return LookUp(len(req.prompt_token_ids), block_size, tuple(chain), tuple(reporting))


def placement(policy: AffinityPolicy, match: CacheMatch | None, stage: str, req: GenerateRequest,
              in_flight: PlacedInFlight | None = None, stage_rate: float | None = None) -> Placement | None:
    """The worker of `stage` to place the request for, with its bound (scheduler/prefix.py `choose`,
    on this machine's clock; `stage_rate`: the stage's measured prefill tokens/s); None: the shared queue."""
    c = choose(policy, match, stage, req.request_id, now_ms(), req.deadline_ms, in_flight, stage_rate)
    return None if c is None else Placement(c.worker, c.until_ms, c.matched_blocks)
