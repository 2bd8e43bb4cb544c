"""The prefix-cache oracle: what one infinite prefix cache would have hit for a request sequence (pure).

The bound against which a system's prefix-cache hit rate is read: a fleet of N engines, each with
its own cache, can at best hit what a single cache holding everything would. Per request: the
longest leading run of its prompt's whole blocks (the engine's block size) that the prompt + output
of any request sent before its first token contained (`oracle_cached_tokens`), hashed as Skyline's
block chain is (scheduler/prefix.py).
As vLLM does, the prompt's last token is always computed: a prompt whose every block is cached
hits one block less. Earlier requests count once sent (generous: a cache gets a prompt's blocks only
as its prefill runs, and an answer's as it is generated), which keeps the oracle an upper bound.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from skyline.scheduler.prefix import block_chain, matched_blocks


def _chain(token_ids: Sequence[int], block_size: int) -> list[str]:
    return block_chain(token_ids, block_size, len(token_ids) // block_size + 1)


def oracle_cached_tokens(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], block_size: int,
                         windows: Sequence[tuple[float, float]] | None = None) -> list[int]:
    """Cached prompt tokens per request; `sequences`: (prompt token ids, output token ids).

    `windows`: each request's (sent, first token) times. A request may hit what any other request
    sent before its first token holds: requests overtake each other in a fleet (the one sent second
    can be prefilled first, and the first then finds its prefix cached), so send order alone is no
    upper bound. Without windows, send order: each request sees those listed before it."""
    return oracle_of_chains([_chain(p, block_size) for p, _ in sequences],
                            [_chain([*p, *o], block_size) for p, o in sequences],
                            [len(p) for p, _ in sequences], block_size, windows)


def oracle_of_chains(prompts: Sequence[Sequence[str]], held: Sequence[Sequence[str]], prompt_tokens: Sequence[int],
                     block_size: int, windows: Sequence[tuple[float, float]] | None = None) -> list[int]:
    """`oracle_cached_tokens` over requests given as block chains (the simulator's): each one's prompt
    chain, the chain of its prompt + output (what a cache holds after it), its prompt length."""
    n = len(prompts)
    if windows is None:
        windows = [(float(i), i + 0.5) for i in range(n)]
    held_by = [Counter(h) for h in held]
    by_send = sorted(range(n), key=lambda i: windows[i][0])
    now_held: Counter[str] = Counter()
    out = [0] * n
    added = 0
    for b in sorted(range(n), key=lambda i: windows[i][1]):
        while added < n and windows[by_send[added]][0] < windows[b][1]:
            now_held.update(held_by[by_send[added]])
            added += 1
        own = held_by[b] if windows[b][0] < windows[b][1] else Counter()  # b itself is in `now_held`: not its own hit
        others = [h for h in prompts[b] if now_held[h] - own[h] > 0]
        usable = max(0, prompt_tokens[b] - 1) // block_size  # vLLM computes at least the last prompt token
        out[b] = min(matched_blocks(prompts[b], set(others)), usable) * block_size
    return out
