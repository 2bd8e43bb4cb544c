"""Analytical engine model: a roofline from GPU datasheet figures and the model's shape.

A step costs the larger of its compute time and its memory time, plus a fixed
per-step overhead and the tensor-parallel all-reduces:

  compute = FLOPs / (peak bf16 FLOP/s x MFU x tp)
  memory  = bytes / (HBM bandwidth x MBU x tp)
  FLOPs   = 2 x (matmul params) x tokens                      dense layers
          + 4 x layers x (heads x head_dim) x attended pairs   QK^T and AV
          + 2 x hidden x vocab x (sequences sampled)           LM head
  bytes   = weights (read once per step) + KV read and written
  all-reduce (tp > 1) = 2 per layer of tokens x hidden x 2 bytes, ring: 2 (tp-1)/tp over NVLink

Efficiency factors are explicit and documented (docs/simulator.md): MFU
(model FLOP utilisation) 0.6 and MBU (memory bandwidth utilisation) 0.7 by
default, a 2 ms step overhead. With these, OPT-13B on one A100 gives 72 ms
for a 512-token prefill and 20 ms for a one-sequence decode step, close to
the A100 profile DistServe published with its simulator (70 ms and 20 ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from skyline.tools.simulate.perf import Chunk, PerfModel


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float  # dense peak, FLOP/s (no sparsity)
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per GPU, one direction (tensor-parallel all-reduce, same-node KV pulls)
    network_bytes_per_s: float  # per GPU, between nodes (InfiniBand/RoCE NIC per GPU)


# Datasheet figures (SXM parts). NVLink: A100 600 GB/s and H100/H200 900 GB/s bidirectional -> half per direction.
GPUS = {
    "A100": Gpu("A100-SXM4-80GB", 312e12, 2.039e12, 80e9, 300e9, 25e9),  # HDR 200 Gb/s per GPU
    "H100": Gpu("H100-SXM5-80GB", 989e12, 3.35e12, 80e9, 450e9, 50e9),  # NDR 400 Gb/s per GPU
    "H200": Gpu("H200-SXM-141GB", 989e12, 4.8e12, 141e9, 450e9, 50e9),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool  # Llama-style SwiGLU (3 matrices) vs OPT-style (2)
    tied_embeddings: bool
    max_context: int
    dtype_bytes: int = 2

    @property
    def matmul_params(self) -> int:
        """Weights of the dense layers (each is 2 FLOPs per token): attention projections + MLP."""
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = self.hidden * self.intermediate * (3 if self.gated_mlp else 2)
        return self.layers * (attn + mlp)

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.matmul_params + embed

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_width(self) -> int:
        return self.heads * self.head_dim


MODELS = {
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, True, True, 2048),
    "llama-3-8b": ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, True, False, 8192),
    "opt-13b": ModelShape("OPT-13B", 40, 5120, 40, 40, 128, 20480, 50272, False, True, 2048),
}


@dataclass(frozen=True)
class Efficiency:
    mfu: float = 0.6  # share of peak FLOP/s a step reaches when compute-bound
    mbu: float = 0.7  # share of HBM bandwidth a step reaches when memory-bound
    step_overhead_s: float = 0.002  # scheduling, sampling, kernel launches per step
    memory_utilisation: float = 0.9  # share of GPU memory for weights + KV cache (vLLM gpu_memory_utilization)
    kv_latency_s: float = 0.001  # fixed cost of one KV pull (handshake, descriptors)


class RooflineModel(PerfModel):
    def __init__(self, gpu: Gpu, model: ModelShape, tp: int = 1, eff: Efficiency | None = None,
                 max_step_tokens: int = 8192, kv_link: str = "network"):
        if tp < 1:
            raise ValueError("tensor parallelism must be >= 1")
        self.gpu, self.model, self.tp, self.eff = gpu, model, tp, eff or Efficiency()
        self.name = f"roofline {model.name} on {tp}x {gpu.name}"
        self.devices = tp
        self.max_step_tokens = max_step_tokens
        self.kv_bytes_per_token = float(model.kv_bytes_per_token)
        self.weight_bytes = model.params * model.dtype_bytes
        free = gpu.memory_bytes * self.eff.memory_utilisation * tp - self.weight_bytes
        if free <= 0:
            raise ValueError(f"{model.name} ({self.weight_bytes / 1e9:.0f} GB) does not fit on {tp}x {gpu.name}")
        self.kv_capacity_tokens = int(free // model.kv_bytes_per_token)
        self.kv_link = kv_link
        link = gpu.nvlink_bytes_per_s if kv_link == "nvlink" else gpu.network_bytes_per_s
        self.kv_bytes_per_s = link * tp  # each shard pulls its own slice of the KV in parallel
        self._flops = gpu.bf16_flops * self.eff.mfu * tp
        self._bw = gpu.hbm_bytes_per_s * self.eff.mbu * tp
        self._decode_lines: dict[int, tuple[float, float, float, float]] = {}
        # _step's constants, hoisted: it runs once per simulated engine step.
        self._flops_per_token = 2 * model.matmul_params
        self._flops_per_pair = 4 * model.layers * model.attn_width
        self._flops_per_sample = 2 * model.hidden * model.vocab

    def _allreduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        per_layer = 2 * tokens * self.model.hidden * self.model.dtype_bytes * 2 * (self.tp - 1) / self.tp
        return self.model.layers * per_layer / self.gpu.nvlink_bytes_per_s

    def _step(self, tokens: int, attended: float, kv_tokens: float, sampled: int) -> float:
        flops = self._flops_per_token * tokens + self._flops_per_pair * attended + self._flops_per_sample * sampled
        bytes_ = self.weight_bytes + self.kv_bytes_per_token * kv_tokens
        step = max(flops / self._flops, bytes_ / self._bw) + self.eff.step_overhead_s
        return step + self._allreduce_s(tokens) if self.tp > 1 else step

    @staticmethod
    def _chunk_work(chunks: Sequence[Chunk]) -> tuple[int, float, float]:
        if len(chunks) == 1:
            p, n = chunks[0]
            return n, n * p + n * (n + 1) / 2, p + n
        tokens = sum(n for _, n in chunks)
        attended = sum(n * p + n * (n + 1) / 2 for p, n in chunks)  # causal: token i attends to p + i earlier ones
        kv = sum(p + n for p, n in chunks)  # prefix read, new KV written
        return tokens, attended, kv

    def prefill_step_s(self, chunks: Sequence[Chunk]) -> float:
        if len(chunks) == 1:  # _chunk_work of one prompt, inlined (once per step of a big run)
            p, n = chunks[0]
            return self._step(n, n * p + n * (n + 1) / 2, p + n, 1)
        tokens, attended, kv = self._chunk_work(chunks)
        return self._step(tokens, attended, kv, len(chunks))

    def decode_coeffs(self, batch: int, context: int) -> tuple[float, float]:
        lines = self._decode_lines.get(batch)
        if lines is None:
            m = self.model
            compute_a = (2 * m.matmul_params * batch + 2 * m.hidden * m.vocab * batch) / self._flops
            compute_b = 4 * m.layers * m.attn_width / self._flops
            memory_a, memory_b = self.weight_bytes / self._bw, m.kv_bytes_per_token / self._bw
            fixed = self.eff.step_overhead_s + self._allreduce_s(batch)
            lines = self._decode_lines[batch] = (compute_a + fixed, compute_b, memory_a + fixed, memory_b)
        ca, cb, ma, mb = lines
        # The regime (compute- or memory-bound) at this context; the simulator re-asks at every batch change.
        return (ca, cb) if ca + cb * context > ma + mb * context else (ma, mb)

    def mixed_step_s(self, chunks: Sequence[Chunk], batch: int, context: int) -> float:
        tokens, attended, kv = self._chunk_work(chunks)
        return self._step(tokens + batch, attended + context, kv + context, len(chunks) + batch)

    def kv_transfer_s(self, tokens: int) -> float:
        return self.eff.kv_latency_s + tokens * self.kv_bytes_per_token / self.kv_bytes_per_s

    def describe(self) -> dict:
        e = self.eff
        return {**super().describe(), "gpu": self.gpu.name, "model": self.model.name, "tp": self.tp,
                "mfu": e.mfu, "mbu": e.mbu, "step_overhead_ms": e.step_overhead_s * 1000, "kv_link": self.kv_link}


def roofline(gpu: str, model: str, tp: int = 1, mfu: float | None = None, mbu: float | None = None,
             max_step_tokens: int = 8192, kv_link: str = "network") -> RooflineModel:
    """A RooflineModel from preset names (case-insensitive)."""
    g = GPUS.get(gpu.upper())
    if g is None:
        raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(GPUS)}")
    m = MODELS.get(model.lower())
    if m is None:
        raise ValueError(f"unknown model {model!r}; presets: {', '.join(MODELS)}")
    eff = Efficiency()
    if mfu is not None:
        eff = replace(eff, mfu=mfu)
    if mbu is not None:
        eff = replace(eff, mbu=mbu)
    return RooflineModel(g, m, tp, eff, max_step_tokens, kv_link)
