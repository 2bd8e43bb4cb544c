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
`block_chain`). The simulated gateway needs every worker's match for every
request, as the live one reads every worker's cache view; a fleet-wide index
(block -> the workers holding it, `HolderIndex`) answers that with a few set
intersections instead of a walk per worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from skyline.scheduler.prefix import matched_blocks


class HolderIndex:
    """Which workers' engines hold each block: the fleet's cache view, kept by the caches themselves."""

    __slots__ = ("of",)

    def __init__(self) -> None:
        self.of: dict[str, set[str]] = {}

    def matched(self, chain: Sequence[str]) -> dict[str, int]:
        """worker -> leading blocks of `chain` it holds, for the workers that hold at least one (the
        others hold none): `matched_blocks` for every worker at once."""
        of = self.of
        live = of.get(chain[0]) if chain else None
        if not live:
            return {}
        out: dict[str, int] = {}
        n = 1
        for h in chain[1:]:
            held = of.get(h, _NONE)
            if not live <= held:  # (else every worker still matching holds it too: a shared system prompt)
                nxt = live & held
                out.update(dict.fromkeys(live - nxt, n))
                if not nxt:
                    return out
                live = nxt
            n += 1
        out.update(dict.fromkeys(live, n))
        return out


_NONE: frozenset = frozenset()


class PrefixCache:
    __slots__ = ("block_size", "blocks", "capacity", "evicted", "index", "name")

    def __init__(self, capacity_blocks: int, block_size: int, name: str = "", index: HolderIndex | None = None):
        """`index`: the fleet's view to keep up to date with what this engine (`name`) holds."""
        self.capacity, self.block_size = max(1, capacity_blocks), block_size
        self.blocks: OrderedDict[str, None] = OrderedDict()
        self.evicted = 0
        self.name, self.index = name, index

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
        blocks, of = self.blocks, self.index.of if self.index is not None else None
        for h in chain[:n]:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                if of is not None:
                    holders = of.get(h)
                    if holders is None:
                        of[h] = {self.name}
                    else:
                        holders.add(self.name)
        over = len(blocks) - self.capacity
        if over > 0:
            self.evicted += over
            pop = blocks.popitem
            for _ in range(over):
                h = pop(last=False)[0]
                if of is not None:
                    holders = of[h]
                    holders.discard(self.name)
                    if not holders:
                        del of[h]

