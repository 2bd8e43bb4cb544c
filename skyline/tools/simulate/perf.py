"""The one interface every engine performance model implements.

An engine runs in steps. A step computes some prompt chunks (prefill) and one
token for each running sequence (decode); vLLM mixes both in one step when
chunked prefill is on. The simulator asks a model three questions:

  prefill_step_s(chunks)         a step that only prefills: chunks are
                                 (tokens already computed, new tokens) per prompt;
  decode_coeffs(batch, context)  a decode-only step of `batch` sequences holding
                                 `context` tokens of KV in total costs
                                 a + b * context (linear in context around that
                                 point), so a batch can be advanced many steps
                                 in closed form;
  mixed_step_s(chunks, batch, context)   both in one step (colocated engines);

plus the KV transfer time of a prompt and the engine's KV capacity. Two
models exist: `perf_profile.ProfileModel` (measured) and
`roofline.RooflineModel` (datasheet figures).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

Chunk = tuple[int, int]  # (prompt tokens already computed, new tokens in this step)


class PerfModel(abc.ABC):
    name: str = "abstract"
    devices: int = 1  # GPUs one engine occupies (tensor parallelism); a CPU engine counts as 1
    max_step_tokens: int = 8192  # tokens per engine step (vLLM max_num_batched_tokens)
    kv_bytes_per_token: float = 0.0
    kv_capacity_tokens: int = 1 << 30  # KV cache of one engine, in tokens
    block_size: int = 16  # KV block (and prefix-cache) size in tokens: vLLM's default on GPUs

    @abc.abstractmethod
    def prefill_step_s(self, chunks: Sequence[Chunk]) -> float:
        """Seconds of a step that computes these prompt chunks and nothing else."""

    @abc.abstractmethod
    def decode_coeffs(self, batch: int, context: int) -> tuple[float, float]:
        """(a, b): a decode step of `batch` sequences with `context` KV tokens costs a + b * context."""

    @abc.abstractmethod
    def mixed_step_s(self, chunks: Sequence[Chunk], batch: int, context: int) -> float:
        """Seconds of a step that computes prompt chunks and one token for each of `batch` running sequences."""

    @abc.abstractmethod
    def kv_transfer_s(self, tokens: int) -> float:
        """Seconds to pull the KV of a `tokens`-token prompt from a prefill engine."""

    def decode_step_s(self, batch: int, context: int) -> float:
        a, b = self.decode_coeffs(batch, context)
        return a + b * context

    def describe(self) -> dict:
        """What the report says about the model (name, key figures)."""
        return {"name": self.name, "devices_per_engine": self.devices, "max_step_tokens": self.max_step_tokens,
                "kv_capacity_tokens": self.kv_capacity_tokens, "block_size": self.block_size}


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation through sorted points, extended linearly beyond both ends."""
    n = len(xs)
    if n == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = n - 2
    else:
        lo, hi = 0, n - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if xs[mid] <= x:
                lo = mid
            else:
                hi = mid
        i = lo
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
