"""Prefix affinity: which engine holds a prompt's prefix, and how long a request waits for it.

The block chain. vLLM's prefix cache reuses a prompt's KV in whole blocks of
`block_size` tokens, each keyed by its tokens and everything before them. Skyline
keys blocks the same way with its own hash (vLLM's hashes depend on a per-process
seed and options the gateway does not know): block i's hash is
H(hash of block i-1, tokens of block i), over full blocks only, at most
`max_blocks` of them, so a prompt at the context limit costs a bounded chain.
The gateway computes the chain of a request's prompt; a worker computes the
same chain over the token ids its engine reports storing (vLLM's KV cache
events, the sim engine's model of them) and keeps the hashes of what its engine
holds in the fleet's cache view (skyline/core/cache_view.py). Two different
prefixes with one hash would cost a cache miss, never a wrong answer: the
engine's own cache decides what it reuses.

Placement (`place`). A request goes to the worker where it costs least, cache
and load together (`cost`: blocks left to compute plus the requests the worker
already has, each worth `load_blocks`), when that worker is not overloaded and
is cheaper than every other by `min_blocks`; otherwise to the shared queue,
where the first worker with room takes it, as without affinity.

The wait (`wait_bound_ms`, `move_ms`, `may_claim`). A placed request waits for
its holder at most `slack_share` of its slack to the TTFT deadline, or, when
moving it would cost more than that (the time another worker takes to recompute
what only the holder has cached: a long conversation's history), up to that
time, but never past its slack, and never more than `max_wait_ms`; past that
bound, or once the holder is gone, any worker may claim it. A request never
waits past its slack for affinity, and no worker idles while work it could take
is past that bound; EDF across tiers is unchanged, because a worker still claims
the earliest deadline among the heads it may claim.

The gateway's decision (`CacheMatch`, `choose`, `PlacedInFlight`). What the
live gateway (gateway/affinity.py, which reads the cache view in Redis) and
the simulator's gateway (skyline/tools/simulate/fleet.py, which reads its
simulated engines) both decide on: each live worker's match and load, the
requests this gateway placed and has not seen end. One copy, so that a
simulated fleet places as the live one does (tests/test_rules_shared.py).
A fleet of hundreds of workers costs a few list operations per worker per
request (`StageLoads`: the heartbeats as placement reads them, which the
simulator keeps from one heartbeat to the next).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import mul, sub
from typing import NamedTuple, Protocol

from skyline.scheduler.elastic import serves

# A worker whose KV cache is this full would evict to make room: not one to wait for (nor one whose
# claim rule stops below it: a decode worker's `kv_watermark`, which its heartbeat carries).
KV_FULL = 0.95

_ROOT = hashlib.blake2b(b"skyline-prefix-chain-v1", digest_size=8).digest()


def block_chain(token_ids: Sequence[int], block_size: int, max_blocks: int, salt: str = "") -> list[str]:
    """The hashes (16 hex digits) of the prompt's full blocks, first to last, at most `max_blocks`.
    `salt`: vLLM's cache_salt (a salted prompt shares no block with an unsalted one)."""
    if block_size <= 0 or max_blocks <= 0:
        return []
    root = _ROOT if not salt else hashlib.blake2b(_ROOT + salt.encode(), digest_size=8).digest()
    return _extend(root, token_ids[:max_blocks * block_size], block_size)


def chain_from(parent: str | None, token_ids: Sequence[int], block_size: int) -> list[str]:
    """The chain of full blocks that follow the block hashed `parent` (None: the prompt's start), as
    a worker extends it over the blocks its engine reports storing."""
    return _extend(_ROOT if parent is None else bytes.fromhex(parent), token_ids, block_size)


def _extend(prev: bytes, token_ids: Sequence[int], block_size: int) -> list[str]:
    out: list[str] = []
    for i in range(len(token_ids) // block_size):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(prev.hex())
    return out


def matched_blocks(chain: Sequence[str], held: Collection[str]) -> int:
    """How many leading blocks of `chain` are in `held` (a prefix cache reuses only a leading run)."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


@dataclass(frozen=True)
class AffinityPolicy:
    enabled: bool = True
    min_blocks: int = 1  # placed only where that saves this many blocks over the next best worker
    slack_share: float = 0.5  # wait for the holder at most this share of the slack to the TTFT deadline
    max_wait_ms: int = 2_000  # and never longer than this
    # What one request a worker holds (or was placed and has not claimed yet) costs, in blocks of
    # prompt to compute: the exchange rate between cache and load (Dynamo's router weighs the two
    # the same way, KV blocks to prefill against blocks already active).
    load_blocks: float = 1.0


class Holder(NamedTuple):
    """One live worker of the stage the request is for, as the gateway sees it (`CacheMatch.holders`;
    `choose` makes only the one it places for)."""

    worker: str
    matched_blocks: int  # leading blocks of the request's chain in its cache view
    overloaded: bool  # full (its heartbeat's running requests at max_running), or its KV cache nearly is
    load: float = 0.0  # requests it holds or has waiting for it


def cost(policy: AffinityPolicy, h: Holder) -> float:
    """What serving the request on `h` costs, in blocks, up to a constant shared by all workers (the
    prompt's length): the blocks it would compute, less those cached, plus its load."""
    return policy.load_blocks * h.load - h.matched_blocks


def place(policy: AffinityPolicy, holders: Sequence[Holder]) -> Holder | None:
    """The worker to wait for, or None (the shared queue, where the first worker with room takes it).

    The cheapest worker not overloaded (`cost`: cache and load together), if it is cheaper than
    every other such worker by at least `min_blocks` and its cache holds some of the prompt. A
    holder of the prompt's prefix wins while its load does not outweigh what its cache saves; past
    that the request goes to the shared queue, so that one worker holding a popular prefix (a system
    prompt) does not draw every request. Where no worker is cheaper (all hold as much, equally
    loaded), or the cheapest holds nothing (it is only less loaded), the shared queue balances the
    load better than a choice would: the first worker with room takes the request, where a placed
    one waits for its worker, chosen on heartbeats up to a second old."""
    if not policy.enabled:
        return None
    ready = [h for h in holders if not h.overloaded]
    k = cheapest(policy, [cost(policy, h) for h in ready])
    return None if k is None or ready[k].matched_blocks <= 0 else ready[k]


def cheapest(policy: AffinityPolicy, costs: Sequence[float]) -> int | None:
    """Where in `costs` (the workers not overloaded, in order) the one to wait for is: the first of
    the cheapest, if it is cheaper than every other by at least `min_blocks`; else None."""
    if not costs:
        return None
    best = min(costs)
    k = costs.index(best)  # the first of the cheapest: a tie goes to the earlier worker
    if len(costs) > 1:
        second = min(min(costs[:k], default=math.inf), min(costs[k + 1:], default=math.inf))
        if second - best < max(1, policy.min_blocks):
            return None
    return k


def wait_bound_ms(policy: AffinityPolicy, now_ms: int, deadline_ms: int, move_ms: float = 0.0) -> int:
    """Until when (Unix ms) only the holder may claim a request placed now: a share of its slack, or
    `move_ms` (what moving it costs: another worker recomputing what the holder has cached) where
    that is longer: a holder free within that time serves it no later than moving it at once would,
    and one still busy costs at most twice that (ski rental). Never past the slack: a request
    that would miss its deadline waiting is free to go anywhere by then."""
    slack = max(0, deadline_ms - now_ms)
    wait = max(policy.slack_share * slack, min(move_ms, slack))
    return now_ms + min(policy.max_wait_ms, int(wait))


def move_ms(saved_tokens: int, stage_rate: float | None, workers: int) -> float:
    """What moving a placed request off its holder costs: the `saved_tokens` the holder has cached and
    the next best worker has not, recomputed at one worker's share of the stage's measured prefill
    rate (`stage_rate`, tokens/s of the `workers` of the stage together; None: not measured yet, 0)."""
    if not stage_rate or workers <= 0 or saved_tokens <= 0:
        return 0.0
    return saved_tokens * 1000.0 * workers / stage_rate


def may_claim(me: str, holder: str, now_ms: int, until_ms: int, holder_alive: bool) -> bool:
    """May worker `me` claim an entry placed for `holder` until `until_ms`?"""
    return me == holder or now_ms >= until_ms or not holder_alive


class WorkerLoad(Protocol):
    """What a worker's heartbeat says that placement reads (the live `WorkerInfo`, or a simulated
    worker's heartbeat)."""

    worker_id: str
    role: str
    running: int
    max_running: int
    kv_usage: float
    kv_watermark: float  # 0: it claims at any KV usage


def overloaded(w: WorkerLoad) -> bool:
    """Full by its last heartbeat: as many requests as it may hold, a KV usage at which its claim rule
    takes nothing more (`ClaimRoom.decode`), or a KV cache about to evict."""
    return (w.max_running > 0 and w.running >= w.max_running) or w.kv_usage >= min(w.kv_watermark or KV_FULL, KV_FULL)


class StageLoads:
    """The live workers of one stage as placement reads their last heartbeats, in the fleet view's
    order (a tie goes to the earlier worker): each one's id, its running requests and whether it may
    take a request (`overloaded`). A caller that keeps it from one heartbeat read to the next (the
    simulator's gateway) passes it to every `CacheMatch` of that time; a request then costs a few
    list operations per worker instead of an object and a heartbeat read each (a fleet of 500)."""

    __slots__ = ("ids", "positions", "ready", "ready_at", "running")

    def __init__(self, workers: Sequence[WorkerLoad], stage: str):
        of_stage = [w for w in workers if serves(w.role, stage)]
        self.ids = tuple(w.worker_id for w in of_stage)
        self.running = [w.running for w in of_stage]
        self.ready = [not overloaded(w) for w in of_stage]
        self.ready_at = [i for i, r in enumerate(self.ready) if r]  # where the workers not overloaded are
        self.positions: dict[str, list[int]] = {}  # worker id -> where it is in `ids`
        for i, w in enumerate(self.ids):
            self.positions.setdefault(w, []).append(i)


@dataclass(frozen=True)
class CacheMatch:
    """What the live workers' engines hold of one prompt."""

    prompt_tokens: int
    block_size: int
    matched: Mapping[str, int]  # worker id -> leading blocks of the prompt its engine holds
    workers: tuple[WorkerLoad, ...]  # those reporting a cache of `block_size`
    # stage -> its `StageLoads` of `workers`, when the caller keeps them between heartbeats; else
    # built here, once per match and stage.
    loads: Mapping[str, StageLoads] | None = field(default=None, compare=False, repr=False)
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def stage(self, stage: str) -> StageLoads:
        """The workers of `stage`, as `StageLoads`."""
        s = self._memo.get(stage)
        if s is None:
            s = (self.loads or {}).get(stage) or StageLoads(self.workers, stage)
            self._memo[stage] = s
        return s

    def _matched_of(self, stage: str) -> list[int]:
        """Each worker of `stage`'s match, in `stage(stage)`'s order."""
        key = ("matched", stage)
        m = self._memo.get(key)
        if m is None:
            m = self._memo[key] = list(map(self.matched.get, self.stage(stage).ids, repeat(0)))
        return m

    def _loads_of(self, stage: str, placed: Mapping[str, int] | None) -> list[int]:
        """Each worker of `stage`'s load: its heartbeat's running requests, or what this gateway has
        placed for it and not seen end (`placed`), whichever is more."""
        s = self.stage(stage)
        if not placed:
            return s.running
        loads, positions = s.running.copy(), s.positions
        for w, n in placed.items():  # (the workers with requests placed: fewer than all)
            for i in positions.get(w, ()):
                if n > loads[i]:
                    loads[i] = n
        return loads

    def holders(self, stage: str, placed: Mapping[str, int] | None = None) -> list[Holder]:
        """The workers of `stage`, their matches and loads: what they held at their last heartbeat,
        or what this gateway has placed for them and not seen end (`placed`), whichever is more."""
        s = self.stage(stage)
        return [Holder(w, m, not ready, load) for w, m, ready, load
                in zip(s.ids, self._matched_of(stage), s.ready, self._loads_of(stage, placed))]

    def place(self, policy: AffinityPolicy, stage: str, placed: Mapping[str, int] | None = None) -> Holder | None:
        """`place(policy, self.holders(stage, placed))`, without a `Holder` per worker: the costs of the
        workers not overloaded, and the two least (ties to the earlier worker, as `place`'s)."""
        if not policy.enabled:
            return None
        s, matched, loads = self.stage(stage), self._matched_of(stage), self._loads_of(stage, placed)
        # The cost of each worker not overloaded (`cost`'s arithmetic, so the same floats), in order.
        costs = list(map(sub, map(mul, repeat(policy.load_blocks), loads), matched))
        if len(s.ready_at) < len(costs):
            costs = list(compress(costs, s.ready))
        k = cheapest(policy, costs)
        if k is None:
            return None
        i = s.ready_at[k]
        if matched[i] <= 0:  # only less loaded: the shared queue balances better (`place`)
            return None
        return Holder(s.ids[i], matched[i], False, loads[i])

    def saved_tokens(self, stage: str, worker: str) -> int:
        """Prompt tokens `worker`'s cache saves over the best of the other workers of `stage` (full or
        not): what moving a request off it would cost in tokens to recompute."""
        s = self.stage(stage)
        others = [m for w, m in zip(s.ids, self._matched_of(stage)) if w != worker]
        runner_up = max(others, default=0)
        return max(0, self._cached(self.matched.get(worker, 0)) - self._cached(runner_up))

    def _cached(self, blocks: int) -> int:
        """Prompt tokens `blocks` leading cached blocks spare (vLLM computes the prompt's last token)."""
        return max(0, min(blocks * self.block_size, self.prompt_tokens - 1))

    def uncached_tokens(self, worker: str | None) -> int:
        """Prompt tokens `worker` would compute (None: a worker not known in advance, so all of them).
        vLLM computes at least the prompt's last token, even when every block is cached."""
        if worker is None:
            return self.prompt_tokens
        return self.prompt_tokens - self._cached(self.matched.get(worker, 0))

    def best_uncached(self, stage: str) -> int:
        """Prompt tokens left to compute on the best-placed worker of `stage` that is not full (the
        one holding the most leading blocks: fewer tokens left is more blocks held)."""
        best = max(compress(self._matched_of(stage), self.stage(stage).ready), default=None)
        if best is None:
            return self.prompt_tokens
        return self.prompt_tokens - self._cached(best)


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


@dataclass(frozen=True)
class Choice:
    """Where the gateway places one request: the worker, until when it alone may claim it, and how
    many leading blocks of the prompt its engine holds."""

    worker: str
    until_ms: int
    matched_blocks: int


def choose(policy: AffinityPolicy, match: CacheMatch | None, stage: str, request_id: str, now_ms: int,
           deadline_ms: int, in_flight: PlacedInFlight | None = None, stage_rate: float | None = None) -> Choice | None:
    """The worker of `stage` to place a request for, with its bound; None: the shared queue (with fewer
    than two workers of the stage the shared queue reaches the same engine anyway). A placement is
    counted in `in_flight` (the caller says `done` when the request ends or is refused).
    `stage_rate`: the stage's measured prefill tokens/s (admission's `pool_rate`), for what moving
    the request would cost (`move_ms`); None: only the slack share bounds the wait."""
    if match is None or not policy.enabled:
        return None
    workers = len(match.stage(stage).ids)
    if workers < 2:
        return None
    best = match.place(policy, stage, in_flight.count if in_flight else None)
    if best is None:
        return None
    if in_flight is not None:
        in_flight.add(request_id, best.worker)
    moving = move_ms(match.saved_tokens(stage, best.worker), stage_rate, workers)
    return Choice(best.worker, wait_bound_ms(policy, now_ms, deadline_ms, moving), best.matched_blocks)
