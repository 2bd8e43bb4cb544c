"""SLO tiers and the per-request SLO derived from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    """A class of service: latency targets and the engine priority it maps to.

    `ttft_ms`: time-to-first-token target; `tpot_ms`: time-per-output-token
    target; `priority`: vLLM's request priority (lower is scheduled first);
    `drop_late_ms`: a request still queued this long past its deadline is
    failed (503, `deadline_exceeded`) rather than served late, freeing the
    capacity for requests that can still make it; -1 = always serve.
    """

    name: str
    ttft_ms: int
    tpot_ms: int
    priority: int
    drop_late_ms: int = -1


# Defaults sized for the 2-core CPU reference machine and the default 135M
# model (unloaded: TTFT ~0.1-0.4 s, TPOT ~75-150 ms). GPU fleets tighten them
# in config.
DEFAULT_TIERS: tuple[Tier, ...] = (
    # A chat user who has waited 10 s for a first token has left; a batch job has not.
    Tier("interactive", ttft_ms=1_000, tpot_ms=250, priority=0, drop_late_ms=9_000),
    Tier("standard", ttft_ms=5_000, tpot_ms=500, priority=1, drop_late_ms=55_000),
    Tier("batch", ttft_ms=60_000, tpot_ms=2_000, priority=2),
)


@dataclass(frozen=True)
class Slo:
    tier: str
    ttft_ms: int
    tpot_ms: int
    priority: int
    arrival_ms: int

    @property
    def deadline_ms(self) -> int:
        """Deadline of the first token: arrival + TTFT target."""
        return self.arrival_ms + self.ttft_ms


class SloError(ValueError):
    """A requested SLO that cannot be honoured as asked (unknown tier, bad target)."""


def resolve_slo(
    tiers: tuple[Tier, ...],
    default_tier: str,
    arrival_ms: int,
    tier: str | None = None,
    ttft_ms: int | None = None,
    tpot_ms: int | None = None,
) -> Slo:
    """The SLO of one request: its tier's targets, optionally tightened.

    A client may only tighten targets (a looser target than the tier's would
    let it jump the queue of a stricter tier). A request that tightens its TTFT
    below its tier's target moves to the strictest tier whose target is still
    at or above the request's, so that FIFO order within a tier stream stays
    earliest-deadline-first.
    """
    by_name = {t.name: t for t in tiers}
    name = tier or default_tier
    if name not in by_name:
        raise SloError(f"unknown SLO tier {name!r}; expected one of: {', '.join(by_name)}")
    chosen = by_name[name]
    for label, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if value is not None and value <= 0:
            raise SloError(f"SLO {label} must be a positive number of milliseconds, got {value}")
    ttft = min(ttft_ms, chosen.ttft_ms) if ttft_ms is not None else chosen.ttft_ms
    tpot = min(tpot_ms, chosen.tpot_ms) if tpot_ms is not None else chosen.tpot_ms
    if ttft < chosen.ttft_ms:
        chosen = tier_for_ttft(tiers, ttft)
    return Slo(tier=chosen.name, ttft_ms=ttft, tpot_ms=tpot, priority=chosen.priority, arrival_ms=arrival_ms)


def tier_for_ttft(tiers: tuple[Tier, ...], ttft_ms: int) -> Tier:
    """The loosest tier whose TTFT target is <= `ttft_ms` (the strictest tier if none is)."""
    ordered = sorted(tiers, key=lambda t: t.ttft_ms)
    fitting = [t for t in ordered if t.ttft_ms <= ttft_ms]
    return fitting[-1] if fitting else ordered[0]
