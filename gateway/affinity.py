"""Prefix affinity in the gateway: what each engine holds of a prompt, and where to place it.

The policy is scheduler/prefix.py's; this module gathers what it decides on: the
live workers (the fleet view's heartbeats: role, load, block size) and how many
leading blocks of the prompt each one's engine holds (the cache view in Redis,
read for every worker of both stages in the same round trip as admission
control's backlog). Skipped, at no cost, when no live worker reports a prefix
cache or the prompt is shorter than a block.

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
from skyline.scheduler.prefix import AffinityPolicy, Holder, block_chain, place, wait_bound_ms

# A worker whose KV cache is this full would evict to make room: not one to wait for.
KV_FULL = 0.95


@dataclass(frozen=True)
class CacheMatch:
    """What the live workers' engines hold of one prompt."""

    prompt_tokens: int
    block_size: int
    matched: dict[str, int]  # worker id -> leading blocks of the prompt its engine holds
    workers: tuple[WorkerInfo, ...]  # those reporting a cache of `block_size`

    def holders(self, stage: str, placed: dict[str, int] | None = None) -> list[Holder]:
        """The workers of `stage`, their matches and loads: what they held at their last heartbeat,
        or what this gateway has placed for them and not seen end (`placed`), whichever is more."""
        placed = placed or {}
        return [Holder(w.worker_id, self.matched.get(w.worker_id, 0), overloaded(w),
                       max(w.running, placed.get(w.worker_id, 0))) for w in self.workers if w.role == stage]

    def uncached_tokens(self, worker: str | None) -> int:
        """Prompt tokens `worker` would compute (None: a worker not known in advance, so all of them).
        vLLM computes at least the prompt's last token, even when every block is cached."""
        if worker is None:
            return self.prompt_tokens
        cached = min(self.matched.get(worker, 0) * self.block_size, self.prompt_tokens - 1)
        return self.prompt_tokens - max(0, cached)

    def best_uncached(self, stage: str) -> int:
        """Prompt tokens left to compute on the best-placed worker of `stage` that is not full."""
        ready = [h for h in self.holders(stage) if not h.overloaded]
        return min((self.uncached_tokens(h.worker) for h in ready), default=self.prompt_tokens)


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
    if not reporting:
        return None
    block_size = reporting[0].cache_block_size  # one model, one block size; others are not comparable
    reporting = [w for w in reporting if w.cache_block_size == block_size]
    chain = block_chain(req.prompt_token_ids, block_size, max_blocks, req.cache_salt or "")
    return LookUp(len(req.prompt_token_ids), block_size, tuple(chain), tuple(reporting))


def placement(policy: AffinityPolicy, match: CacheMatch | None, stage: str, req: GenerateRequest,
              in_flight: PlacedInFlight | None = None) -> Placement | None:
    """The worker of `stage` to place the request for, with its bound; None: the shared queue (with
    fewer than two workers of the stage the shared queue reaches the same engine anyway)."""
    if match is None or not policy.enabled:
        return None
    holders = match.holders(stage, in_flight.count if in_flight else None)
    if len(holders) < 2:
        return None
    best = place(policy, holders)
    if best is None:
        return None
    if in_flight is not None:
        in_flight.add(req.request_id, best.worker)
    return Placement(best.worker, wait_bound_ms(policy, now_ms(), req.deadline_ms), best.matched_blocks)


class PlacedInFlight:
    """The requests this gateway placed for each worker that have not ended yet: load the worker's
    heartbeat (every second, read every half second) may not show yet. Without it a burst would
    see the same loads and go to one worker. A worker's load is the larger of the two counts (the
    heartbeat's covers other gateways and unplaced work, this one what was placed since)."""

    def __init__(self) -> None:
        self.worker_of: dict[str, str] = {}  # request id -> the worker it was placed for
        self.count: dict[str, int] = {}

    def add(self, request_id: str, worker: str) -> None:
        self.done(request_id)
        self.worker_of[request_id] = worker
        self.count[worker] = self.count.get(worker, 0) + 1

    def done(self, request_id: str) -> None:
        """The request ended, or was refused before it was enqueued (idempotent)."""
        worker = self.worker_of.pop(request_id, None)
        if worker is not None:
            self.count[worker] -= 1
            if not self.count[worker]:
                del self.count[worker]


def overloaded(w: WorkerInfo) -> bool:
    """Full by its last heartbeat: as many requests as it may hold, or a KV cache about to evict."""
    return (w.max_running > 0 and w.running >= w.max_running) or w.kv_usage >= KV_FULL
