"""PNG plots of a benchmark's results (matplotlib, Agg backend: no display needed).

  attainment_vs_rate.png   SLO attainment vs request rate, one line per system
  ttft_cdf_by_tier.png     TTFT CDF per tier at the highest rate, one line per system
  throughput_vs_rate.png   output tok/s and total tok/s vs request rate
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless servers have no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from skyline.tools.bench.metrics import SLO_GOAL  # noqa: E402


def _by_system(results: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in results["runs"]:
        out.setdefault(run["system"], []).append(run)
    return {k: sorted(v, key=lambda r: r["rate"]) for k, v in out.items()}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return path


def plot_attainment(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for system, runs in _by_system(results).items():
        ax.plot([r["rate"] for r in runs], [100 * r["summary"]["attainment"] for r in runs], marker="o", label=system)
    ax.axhline(100 * SLO_GOAL, color="grey", linestyle="--", linewidth=1, label=f"{SLO_GOAL:.0%} goal")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-3, 103), title="SLO attainment vs rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ttft_cdf(results: dict, path: Path) -> Path:
    records = results["records"]
    top_rate = max((r["rate"] for r in results["runs"]), default=0.0)
    tiers = sorted({r["tier"] for r in records})
    fig, axes = plt.subplots(1, max(1, len(tiers)), figsize=(5 * max(1, len(tiers)), 3.8), squeeze=False)
    for ax, tier in zip(axes[0], tiers):
        for system in _by_system(results):
            mine = [r for r in records if r["system"] == system and r["tier"] == tier and r["rate"] == top_rate]
            # Requests that never produced a first token have an infinite TTFT: the
            # curve tops out below 1, so a system that sheds or fails cannot look fast.
            ttfts = sorted(r["ttft_s"] * 1000 for r in mine if r["outcome"] == "ok")
            if not mine:
                continue
            if not ttfts:  # nothing completed: keep the system in the legend with its 0/N
                ax.plot([], [], label=f"{system} (0/{len(mine)} ok)")
                continue
            ys = [(i + 1) / len(mine) for i in range(len(ttfts))]
            # Start each curve at 0 so a system with a single completed request still draws a visible step.
            xs = ttfts[:1] + ttfts
            ax.step(xs, [0.0] + ys, where="post", marker=".", label=f"{system} ({len(ttfts)}/{len(mine)} ok)")
        targets = {r["ttft_target_ms"] for r in records if r["tier"] == tier}
        for t in targets:
            ax.axvline(t, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.02), title=f"{tier} @ {top_rate:g} req/s")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor tick labels overlap on a log axis
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_throughput(results: dict, path: Path) -> Path:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for system, runs in _by_system(results).items():
        rates = [r["rate"] for r in runs]
        ax1.plot(rates, [r["summary"]["output_throughput"] for r in runs], marker="o", label=system)
        ax2.plot(rates, [r["summary"]["total_token_throughput"] for r in runs], marker="o", label=system)
    ax1.set(xlabel="request rate (req/s)", ylabel="output tok/s", title="output tokens/s vs rate")
    ax2.set(xlabel="request rate (req/s)", ylabel="total tok/s (prompt + output)", title="total tokens/s vs rate")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_all(results: dict, out_dir: Path) -> list[Path]:
    return [
        plot_attainment(results, out_dir / "attainment_vs_rate.png"),
        plot_ttft_cdf(results, out_dir / "ttft_cdf_by_tier.png"),
        plot_throughput(results, out_dir / "throughput_vs_rate.png"),
    ]
