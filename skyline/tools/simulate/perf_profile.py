"""Engine model from a measured profile (`skyline profile`): interpolation, no physics.

Prefill. The profile holds F(N): the time to prefill one N-token prompt on the
engine as the fleet configures it (chunked into max_step_tokens steps). A
step computing chunk (p, n) of a prompt costs F(p + n) - F(p), with F(0) = 0,
so the chunks of one prompt add up to exactly the measured F(N). Prompts that
start in the same step share one fixed step cost a0 (F extrapolated to zero
tokens): k prompts of n tokens cost k F(n) - (k - 1) a0. The measured batch
points check that rule (`batch_error` in describe()).

Decode. For each measured batch size B the step time is fitted as
a_B + b_B x context (least squares over its context points); between batch
sizes a and b are interpolated linearly, beyond them extended linearly.

Mixed steps (colocated engines) cost the prefill chunks plus the decode
step's work beyond the shared fixed cost a0.

KV transfer ("kv_transfer": latency_s + bytes / bytes_per_s; bytes_per_s
null = no per-byte term) is what a hand-off costs beyond the decode step
that samples the first token: measured between two engines by
`skyline profile --handoff`, or a hand figure in older profiles.

Slowdown ("slowdown": {"factor", "source"}, or `--slowdown`): every engine
step costs `factor` times the profiled time. The profile is measured on an
engine running alone; in a fleet on a small host the gateway, Redis, the
load generator and the other engines share the cores. `calibrate.py`
derives the factor from a measured run's solo phases. KV transfer times are
not scaled (the hand-off measurement already ran next to a second engine).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from skyline.tools.simulate.perf import Chunk, PerfModel, interp

CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 128, 16  # vLLM's default KV block sizes


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); slope 0 through one point."""
    n = len(xs)
    if n == 1 or max(xs) == min(xs):
        return sum(ys) / n, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


class ProfileModel(PerfModel):
    def __init__(self, profile: dict, name: str = "profile", slowdown: float | None = None,
                 handoff_s: float | None = None, decode_slowdown: float | None = None):
        """`decode_slowdown` (default: `slowdown`) prices decode tokens apart from prompt chunks: a
        colocated engine's steps carry both, and the fleet's host slows them by different factors."""
        if profile.get("kind") != "skyline-engine-profile":
            raise ValueError("not a Skyline engine profile (expected kind = skyline-engine-profile)")
        self.profile = profile
        self.name = name
        self.devices = 1
        self.max_step_tokens = int(profile["max_step_tokens"])
        self.kv_bytes_per_token = float(profile["kv_bytes_per_token"])
        self.kv_capacity_tokens = int(profile["kv_capacity_tokens"])
        # vLLM's block: 128 tokens on CPU (a profile of no GPU), 16 on GPUs, unless the profile says
        self.block_size = int(profile.get("block_size") or (CPU_BLOCK_SIZE if not profile.get("gpus_per_engine")
                                                           else GPU_BLOCK_SIZE))
        kv = profile["kv_transfer"]
        self.kv_latency_s = float(kv["latency_s"]) if handoff_s is None else handoff_s
        self.kv_bytes_per_s = float(kv["bytes_per_s"]) if kv.get("bytes_per_s") else None
        self.slowdown = float(profile.get("slowdown", {}).get("factor", 1.0)) if slowdown is None else slowdown
        self.decode_slowdown = self.slowdown if decode_slowdown is None else decode_slowdown
        if self.slowdown <= 0 or self.decode_slowdown <= 0:
            raise ValueError(f"a slowdown must be positive, got {self.slowdown} / {self.decode_slowdown}")
        single = sorted((p["tokens"], p["seconds"]) for p in profile["prefill"] if p["seqs"] == 1)
        if len(single) < 2:
            raise ValueError("a profile needs at least two single-prompt prefill points")
        self._px = [float(t) for t, _ in single]
        self._py = [s * self.slowdown for _, s in single]
        self.a0 = min(max(0.0, interp(self._px, self._py, 0.0)), self._py[0])
        by_batch: dict[int, list[tuple[float, float]]] = {}
        for d in profile["decode"]:
            by_batch.setdefault(int(d["batch"]), []).append((float(d["context_tokens"]), float(d["step_s"])))
        if not by_batch:
            raise ValueError("a profile needs decode points")
        self._bx = sorted(by_batch)
        fits = [_fit_line([c for c, _ in by_batch[b]], [s for _, s in by_batch[b]]) for b in self._bx]
        self._ba = [a * self.decode_slowdown for a, _ in fits]
        self._bb = [max(0.0, b) * self.decode_slowdown for _, b in fits]

    @classmethod
    def load(cls, path: str | Path, slowdown: float | None = None, handoff_s: float | None = None,
             decode_slowdown: float | None = None) -> ProfileModel:
        """`slowdown` and `handoff_s` (the KV transfer's fixed cost) override the profile's own."""
        p = Path(path)
        return cls(json.loads(p.read_text()), name=f"profile {p.name}", slowdown=slowdown, handoff_s=handoff_s,
                   decode_slowdown=decode_slowdown)

    def _f(self, tokens: float) -> float:
        return interp(self._px, self._py, tokens) if tokens > 0 else 0.0

    def prefill_step_s(self, chunks: Sequence[Chunk]) -> float:
        total, starting = 0.0, 0
        for p, n in chunks:
            total += self._f(p + n) - self._f(p)
            starting += p == 0
        return max(total - max(0, starting - 1) * self.a0, 0.0)

    def decode_coeffs(self, batch: int, context: int) -> tuple[float, float]:
        if len(self._bx) == 1:
            return self._ba[0], self._bb[0]
        a = max(interp(self._bx, self._ba, batch), 0.0)
        return a, max(interp(self._bx, self._bb, batch), 0.0)

    def mixed_step_s(self, chunks: Sequence[Chunk], batch: int, context: int) -> float:
        prefill = self.prefill_step_s(chunks)
        if batch == 0:
            return prefill
        return prefill + max(self.decode_step_s(batch, context) - self.a0, 0.0)

    def kv_transfer_s(self, tokens: int) -> float:
        if self.kv_bytes_per_s is None:
            return self.kv_latency_s
        return self.kv_latency_s + tokens * self.kv_bytes_per_token / self.kv_bytes_per_s

    def batch_error(self) -> float | None:
        """Largest relative error of the shared-overhead rule on the measured batched prefills."""
        errs = []
        for p in self.profile["prefill"]:
            if p["seqs"] > 1:
                n = p["tokens"] // p["seqs"]
                pred = self.prefill_step_s([(0, n)] * p["seqs"]) / self.slowdown
                errs.append(abs(pred - p["seconds"]) / p["seconds"])
        return max(errs) if errs else None

    def describe(self) -> dict:
        e = self.profile.get("engine", {})
        return {**super().describe(), "measured": self.profile.get("measured"), "engine": e,
                "prefill_fixed_ms": round(self.a0 * 1000, 1), "batch_error": self.batch_error(),
                "kv_transfer_source": self.profile["kv_transfer"].get("source"),
                "kv_transfer_latency_ms": round(self.kv_latency_s * 1000, 1), "slowdown": self.slowdown,
                "decode_slowdown": self.decode_slowdown}
