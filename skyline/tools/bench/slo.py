"""SLO targets per request class: given explicitly, or a multiple of unloaded latency (pure).

Derived targets follow DistServe's "SLO scale": run each class alone on the
baseline system (one request at a time, nothing else queued), take the
median TTFT and median TPOT per class, and multiply by the scale. A scale of
5 means "a loaded system may be at most 5x slower than the idle baseline".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from skyline.core.stats import percentile
from skyline.scheduler.tiers import Tier
from skyline.tools.bench.record import BenchRecord


@dataclass
class SloTargets:
    ttft_ms: dict[str, float]  # class -> target
    tpot_ms: dict[str, float]
    source: str  # one sentence for the report: where the numbers come from
    scale: float | None = None
    unloaded: dict[str, dict[str, float]] = field(default_factory=dict)  # class -> {"ttft_ms", "tpot_ms"}

    def for_class(self, cls: str) -> tuple[float, float]:
        return self.ttft_ms[cls], self.tpot_ms[cls]

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "source": self.source, "scale": self.scale,
                "unloaded": self.unloaded}


def derive_targets(probe: list[BenchRecord], scale: float, baseline: str, explicit_ttft: dict[str, float] | None = None,
                   explicit_tpot: dict[str, float] | None = None) -> SloTargets:
    """Targets = scale x the median unloaded latency of each class, unless given explicitly.

    Explicit per-class values win over derived ones, so a user can pin one
    number (e.g. the chat TTFT) and derive the rest.
    """
    unloaded: dict[str, dict[str, float]] = {}
    for cls in sorted({r.cls for r in probe}):
        ok = [r for r in probe if r.cls == cls and r.outcome == "ok"]
        if not ok:
            errors = {r.error for r in probe if r.cls == cls}
            raise RuntimeError(f"every unloaded {cls} request failed on {baseline}: {errors}")
        unloaded[cls] = {"ttft_ms": percentile([r.ttft_s * 1000 for r in ok], 50),
                         "tpot_ms": percentile([r.tpot_s * 1000 for r in ok], 50)}
    ttft = {c: round(scale * u["ttft_ms"]) for c, u in unloaded.items()}
    tpot = {c: round(scale * u["tpot_ms"]) for c, u in unloaded.items()}
    ttft.update(explicit_ttft or {})
    tpot.update(explicit_tpot or {})
    source = (f"{scale:g}x the median unloaded TTFT and TPOT of each class, measured on {baseline} "
              f"(requests sent one at a time)")
    if explicit_ttft or explicit_tpot:
        source += "; explicit options override: " + ", ".join(
            [f"{c} TTFT" for c in (explicit_ttft or {})] + [f"{c} TPOT" for c in (explicit_tpot or {})])
    return SloTargets(ttft, tpot, source, scale, unloaded)


def explicit_targets(ttft: dict[str, float], tpot: dict[str, float]) -> SloTargets:
    return SloTargets(dict(ttft), dict(tpot), "explicit options (--slo-ttft-ms / --slo-tpot-ms)")


def fleet_tiers(tiers: tuple[Tier, ...], targets: SloTargets, tier_of: Callable[[str], str]) -> dict[str, dict]:
    """The `[tiers]` a Skyline fleet under test is configured with: `tiers` (its config's), each tier a
    class is sent in carrying that class's targets (the strictest, when several classes share a tier).

    A request's headers may only tighten its tier's targets (skyline.scheduler.tiers.resolve_slo): with
    the tier's defaults stricter than the benchmark's targets, the gateway would refuse (429) requests
    it predicts late for the tier but that would have met the targets they are judged against."""
    ttft: dict[str, float] = {}
    tpot: dict[str, float] = {}
    for cls, value in targets.ttft_ms.items():
        tier = tier_of(cls)
        ttft[tier] = min(ttft.get(tier, math.inf), value)
        tpot[tier] = min(tpot.get(tier, math.inf), targets.tpot_ms[cls])
    out = {}
    for t in tiers:
        values = {k: v for k, v in asdict(t).items() if k != "name"}
        if t.name in ttft:
            values.update(ttft_ms=max(1, round(ttft[t.name])), tpot_ms=max(1, round(tpot[t.name])))
        out[t.name] = values
    return out
