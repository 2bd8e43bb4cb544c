"""The prefix-cache oracle: what one infinite prefix cache would have hit for a request sequence (pure).

The bound against which a system's prefix-cache hit rate is read: a fleet of N engines, each with
its own cache, can at best hit what a single cache holding everything would. Per request, in send
order: the longest leading run of its prompt's whole blocks (the engine's block size) that any
earlier request's prompt + output contained, hashed as Skyline's block chain is (scheduler/prefix.py).
As vLLM does, the prompt's last token is always computed: a prompt whose every block is cached
hits one block less. Earlier requests count once sent (generous: a cache gets a prompt's blocks only
as its prefill runs, and an answer's as it is generated), which keeps the oracle an upper bound.
"""

from __future__ import annotations

from typing import Sequence

from skyline.scheduler.prefix import block_chain, matched_blocks


def _chain(token_ids: Sequence[int], block_size: int) -> list[str]:
    return block_chain(token_ids, block_size, len(token_ids) // block_size + 1)


def oracle_cached_tokens(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], block_size: int) -> list[int]:
    """Cached prompt tokens per request; `sequences`: (prompt token ids, output token ids), in send order."""
    held: set[str] = set()
    out = []
    for prompt, output in sequences:
        usable = max(0, len(prompt) - 1) // block_size  # vLLM computes at least the last prompt token
        out.append(min(matched_blocks(_chain(prompt, block_size), held), usable) * block_size)
        held.update(_chain([*prompt, *output], block_size))
    return out
