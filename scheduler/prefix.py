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

The wait (`wait_bound_ms`, `may_claim`). A placed request waits for its holder
at most `slack_share` of its slack to the TTFT deadline (and never more than
`max_wait_ms`); past that bound, or once the holder is gone, any worker may
claim it. A request never waits past its slack for affinity, and no worker
idles while work it could take is past that bound; EDF across tiers is
unchanged, because a worker still claims the earliest deadline among the heads
it may claim.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Holder:
    """One live worker of the stage the request is for, as the gateway sees it."""

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
    every other such worker by at least `min_blocks`. A holder of the prompt's prefix wins while
    its load does not outweigh what its cache saves; past that the least loaded worker gets the
    request, cached or not, so that one worker holding a popular prefix (a system prompt) does not
    draw every request. Where no worker is cheaper (all hold as much, equally loaded), the shared
    queue balances the load as well as a choice would."""
    if not policy.enabled:
        return None
    ready = sorted((h for h in holders if not h.overloaded), key=lambda h: cost(policy, h))
    if not ready:
        return None
    best = ready[0]
    if len(ready) > 1 and cost(policy, ready[1]) - cost(policy, best) < max(1, policy.min_blocks):
        return None
    return best


def wait_bound_ms(policy: AffinityPolicy, now_ms: int, deadline_ms: int) -> int:
    """Until when (Unix ms) only the holder may claim a request placed now: a share of its slack."""
    slack = max(0, deadline_ms - now_ms)
    return now_ms + min(policy.max_wait_ms, int(policy.slack_share * slack))


def may_claim(me: str, holder: str, now_ms: int, until_ms: int, holder_alive: bool) -> bool:
    """May worker `me` claim an entry placed for `holder` until `until_ms`?"""
    return me == holder or now_ms >= until_ms or not holder_alive
