"""A simulated engine's prefix cache: which blocks of Skyline's chain it holds, evicted LRU.

vLLM keeps a finished request's KV blocks (its prompt's and the answer's full
blocks) in the KV cache until the space is needed, and a later prompt that
starts with the same blocks skips computing them. The model here, as the sim
engine's (workers/engines/sim.py `SimPrefixCache`): the engine's whole KV
capacity in blocks (`PerfModel.kv_capacity_tokens // block_size`), blocks
stored when a prompt is computed and, with the answer's, when the request
leaves the engine, least recently used evicted first. It ignores that blocks
of running requests cannot be evicted (the capacity is the upper bound of what
a lightly loaded engine keeps) and stores a prompt's blocks at its end rather
than step by step.

Blocks are keyed by the request's chain (`SimRequest.chain`, scheduler/prefix.py
`block_chain`), so the simulated gateway reads a worker's match as the live
one reads its cache view (`matched_blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from skyline.scheduler.prefix import matched_blocks


class PrefixCache:
    __slots__ = ("block_size", "blocks", "capacity", "evicted")

    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity, self.block_size = max(1, capacity_blocks), block_size
        self.blocks: OrderedDict[str, None] = OrderedDict()
        self.evicted = 0

    def held(self, chain: Sequence[str], prompt_blocks: int) -> int:
        """Leading blocks of a prompt (the first `prompt_blocks` of `chain`) this engine holds: what the
        gateway's view of it says (nothing is touched)."""
        blocks = self.blocks
        if not prompt_blocks or chain[0] not in blocks:
            return 0  # (the common answer: one look)
        return matched_blocks(chain[:prompt_blocks], blocks)

    def hit(self, req) -> int:
        """Prompt tokens the engine finds cached as it starts `req`'s prompt (its blocks are used
        again: most recently used now); never the whole prompt, as vLLM computes the last token."""
        n = self.held(req.chain, req.prompt_blocks)
        if not n:
            return 0
        move = self.blocks.move_to_end
        for h in req.chain[:n]:
            move(h)
        return min(n * self.block_size, req.prompt_tokens - 1)

    def finished(self, req) -> None:
        """`req` leaves the engine: it keeps the full blocks of its prompt + answer (the last sampled
        token was never fed back, so it has no KV)."""
        self.store(req.chain, min(len(req.chain), (req.prompt_tokens + req.max_tokens - 1) // self.block_size))

    def store(self, chain: Sequence[str], n: int) -> None:
        """The engine now holds the first `n` blocks of `chain` (most recently used), evicting the
        least recently used beyond its capacity."""
        blocks = self.blocks
        for h in chain[:n]:
            blocks[h] = None
            blocks.move_to_end(h)
        over = len(blocks) - self.capacity
        if over > 0:
            self.evicted += over
            pop = blocks.popitem
            for _ in range(over):
                pop(last=False)

