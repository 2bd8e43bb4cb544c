"""Log probabilities on the wire: vLLM's `Logprob` maps as plain msgpack lists and back.

A position is a list of `[token_id, logprob, rank, decoded_token]` entries in
vLLM's order (the sampled or prompt token first, then the top ones); a prompt
position may be None (vLLM has none for the first prompt token). Infinities
travel as msgpack floats, as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Position = list[list[Any]]


def to_wire(positions: Iterable[Mapping[int, Any] | None] | None) -> list[Position | None] | None:
    """vLLM's per-position `{token_id: Logprob}` maps (a list, or vLLM's FlatLogprobs) as lists."""
    if positions is None:
        return None
    out: list[Position | None] = []
    for pos in positions:
        if pos is None:
            out.append(None)
            continue
        out.append([[int(tid), float(lp.logprob), lp.rank, lp.decoded_token] for tid, lp in pos.items()])
    return out


def from_wire(positions: list[Position | None] | None) -> list[dict[int, Any] | None] | None:
    """The lists as vLLM's `{token_id: Logprob}` maps, what its serving layer formats."""
    if positions is None:
        return None
    from vllm.logprobs import Logprob

    return [None if pos is None else {tid: Logprob(logprob=lp, rank=rank, decoded_token=tok)
                                      for tid, lp, rank, tok in pos}
            for pos in positions]
