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
# model, with room above their unloaded TTFT and TPOT. GPU fleets tighten them
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


class TierNotAllowed(SloError):
    """A request for a stricter tier than its tenant may use: not a bad request (400) but one
    this tenant is not permitted (403). `by_target`: asked for by a TTFT target, not by name."""

    def __init__(self, message: str, by_target: bool):
        super().__init__(message)
        self.by_target = by_target


def resolve_slo(
    tiers: tuple[Tier, ...],
    default_tier: str,
    arrival_ms: int,
    tier: str | None = None,
    ttft_ms: int | None = None,
    tpot_ms: int | None = None,
    strictest: str = "",
) -> Slo:
    """The SLO of one request: its tier's targets, optionally tightened.

    A client may only tighten targets (a looser target than the tier's would
    let it jump the queue of a stricter tier). A request that tightens its TTFT
    below its tier's target moves to the strictest tier whose target is still
    at or above the request's, so that FIFO order within a tier stream stays
    earliest-deadline-first.

    `strictest`: the strictest tier the tenant may use ("" = any). A request
    naming no tier gets the default tier, or `strictest` where the default is
    stricter than that; one that asks for a stricter tier, by name or by a TTFT
    target that needs one, is refused (`TierNotAllowed`), not quietly served in
    a looser tier than it asked for.
    """
    by_name = {t.name: t for t in tiers}
    name = tier or default_tier
    if name not in by_name:
        raise SloError(f"unknown SLO tier {name!r}; expected one of: {', '.join(by_name)}")
    floor_ms = by_name[strictest].ttft_ms if strictest else 0  # the config names only existing tiers
    if tier is None and by_name[name].ttft_ms < floor_ms:
        name = strictest
    chosen = by_name[name]
    for label, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms)):
        if value is not None and value <= 0:
            raise SloError(f"SLO {label} must be a positive number of milliseconds, got {value}")
    ttft = min(ttft_ms, chosen.ttft_ms) if ttft_ms is not None else chosen.ttft_ms
    tpot = min(tpot_ms, chosen.tpot_ms) if tpot_ms is not None else chosen.tpot_ms
    if ttft < chosen.ttft_ms:
        chosen = tier_for_ttft(tiers, ttft)
    if chosen.ttft_ms < floor_ms:
        may = ", ".join(t.name for t in allowed_tiers(tiers, strictest))
        by_target = chosen.name != name
        if by_target:
            asked = f"a TTFT target of {ttft} ms needs SLO tier {chosen.name!r}, which"
        else:
            asked = f"SLO tier {name!r}"
        raise TierNotAllowed(f"{asked} is stricter than this API key may use; it may use: {may} "
                             f"(TTFT targets of {floor_ms} ms or more)", by_target)
    return Slo(tier=chosen.name, ttft_ms=ttft, tpot_ms=tpot, priority=chosen.priority, arrival_ms=arrival_ms)


def allowed_tiers(tiers: tuple[Tier, ...], strictest: str) -> tuple[Tier, ...]:
    """The tiers a tenant capped at `strictest` may use: that one and every looser one (TTFT
    target at or above its; the order every queue and worker ranks tiers by). "" = all of them."""
    if not strictest:
        return tiers
    floor_ms = next(t.ttft_ms for t in tiers if t.name == strictest)
    return tuple(t for t in tiers if t.ttft_ms >= floor_ms)


def tier_for_ttft(tiers: tuple[Tier, ...], ttft_ms: int) -> Tier:
    """The loosest tier whose TTFT target is <= `ttft_ms` (the strictest tier if none is)."""
    ordered = sorted(tiers, key=lambda t: t.ttft_ms)
    fitting = [t for t in ordered if t.ttft_ms <= ttft_ms]
    return fitting[-1] if fitting else ordered[0]
