"""The short multi-turn `skyline bench run` the end-to-end bench tests share (sim fleets, one rate)."""

from __future__ import annotations

from pathlib import Path

from skyline.cli import build_parser
from skyline.tools.bench.run import Bench

MAX_PROMPT = 1800


def run_multiturn(out: Path, systems: list[str], rate: float, duration_s: int, mix: float) -> tuple[dict, Path]:
    """A few seconds of sessions at `rate` on each of `systems`: (results, the output folder)."""
    args = build_parser().parse_args([
        "bench", "run", "--workload", "multiturn", "--systems", ",".join(systems), "--rates", str(rate),
        "--duration", str(duration_s), "--drain", "30", "--warmup", "1", "--think-s", "0.3", "--turns", "3-4",
        "--mix", str(mix), "--chat-prompt", "40-200", "--rag-prompt", "1200-1600", "--chat-output", "8-24",
        "--rag-output", "8-16", "--max-prompt-tokens", str(MAX_PROMPT),
        # Explicit targets: no unloaded probe needed, and loose enough for a busy test machine.
        "--slo-ttft-ms", "chat=3000,rag=8000", "--slo-tpot-ms", "1000", "--out", str(out), "--start-timeout", "60",
    ])
    results, _files = Bench(args).run()
    return results, out
