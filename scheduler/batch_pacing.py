"""How many batch requests to keep in flight: fill idle capacity, step aside for live traffic (pure).

The batch runner samples the fleet every `interval` (the `skyline:backlog`
hash: prompt tokens admitted to a stage and not yet prefilled, per tier) and
asks `BatchPacer` for its concurrency limit. The controller is AIMD, the rule
TCP uses to share a link it cannot see into:

- **back off** (multiply by `decrease_factor`) when the stricter tiers'
  backlog is above `backoff_tokens`, or above `fill_tokens` and still
  growing: interactive or standard requests are queueing, and every batch
  request in flight competes with them for prefill steps and decode slots;
  or when their latency nears its target: the worst TTFT/target or
  TPOT/target among stricter-tier requests answered since the last sample
  (`slo_pressure`, from the gateways' `skyline:recent` list) reaches
  `backoff_slo_pressure`. Queues show prefill contention; only latency
  shows decode contention (batch sequences slow every decode step);
- **fill in** (add `increase_step`) when the stricter tiers' backlog is at or
  below `fill_tokens` (the fleet serves live traffic without a queue), their
  latency is at most `fill_slo_pressure` of target, and the batch tier's own
  backlog is below `max_batch_backlog_tokens` (more requests would only wait
  in Redis, not add throughput);
- otherwise **hold**.

Multiplicative decrease reacts to a burst within a sample or two; additive
increase probes for spare capacity slowly, so a brief lull does not flood
the queues just before the next burst. The gateway pushing back on a batch
request (429/503) is a congestion signal too (`pushback`). EDF and
fleet-level preemption already let live requests overtake queued batch work;
pacing keeps the batch from occupying the engines' decode slots and prefill
steps in the first place.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyline.scheduler.tiers import Tier


@dataclass(frozen=True)
class PacingPolicy:
    min_concurrency: int = 1  # never below: batch work keeps moving (0 = pause entirely under load)
    max_concurrency: int = 32
    start_concurrency: int = 4
    backoff_tokens: int = 2048  # stricter-tier backlog above which the batch backs off
    fill_tokens: int = 256  # stricter-tier backlog at or below which the batch fills in
    max_batch_backlog_tokens: int = 8192  # batch-tier backlog beyond which more in flight only queues
    backoff_slo_pressure: float = 0.8  # stricter-tier latency / target at or above which the batch backs off
    fill_slo_pressure: float = 0.5  # ... at or below which it may fill in
    increase_step: int = 2
    decrease_factor: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.min_concurrency <= self.start_concurrency <= self.max_concurrency or self.max_concurrency < 1:
            raise ValueError("batch pacing needs 0 <= min_concurrency <= start_concurrency <= max_concurrency, "
                             f"max >= 1; got {self.min_concurrency}, {self.start_concurrency}, {self.max_concurrency}")
        if self.fill_tokens > self.backoff_tokens:
            raise ValueError(f"fill_tokens ({self.fill_tokens}) must not exceed backoff_tokens ({self.backoff_tokens})")
        if not 0 <= self.fill_slo_pressure <= self.backoff_slo_pressure:
            raise ValueError(f"fill_slo_pressure ({self.fill_slo_pressure}) must be in [0, backoff_slo_pressure "
                             f"({self.backoff_slo_pressure})]")
        if not 0 < self.decrease_factor < 1 or self.increase_step < 1:
            raise ValueError("decrease_factor must be in (0, 1) and increase_step >= 1")


@dataclass(frozen=True)
class FleetLoad:
    """One sample of the fleet, as the runner reads it from `skyline:backlog`."""

    stricter_tokens: int  # prompt tokens queued or in prefill for tiers stricter than the batch tier
    batch_tokens: int  # the same for the batch tier itself
    slo_pressure: float = 0.0  # worst latency/target of stricter-tier answers since the last sample (0: none)


class BatchPacer:
    """AIMD concurrency limit for batch requests. `limit` is the current answer."""

    def __init__(self, policy: PacingPolicy):
        self.policy = policy
        self.limit = policy.start_concurrency
        self._last_stricter: int | None = None

    def observe(self, load: FleetLoad) -> int:
        """Update the limit from one sample of the fleet; returns it."""
        p = self.policy
        grew = self._last_stricter is not None and load.stricter_tokens > self._last_stricter
        self._last_stricter = load.stricter_tokens
        if (load.stricter_tokens > p.backoff_tokens or (load.stricter_tokens > p.fill_tokens and grew)
                or load.slo_pressure >= p.backoff_slo_pressure):
            return self._decrease()
        if (load.stricter_tokens <= p.fill_tokens and load.slo_pressure <= p.fill_slo_pressure
                and load.batch_tokens < p.max_batch_backlog_tokens):
            self.limit = min(p.max_concurrency, self.limit + p.increase_step)
        return self.limit

    def pushback(self) -> int:
        """The gateway refused a batch request for load (429/503): back off like on a growing queue."""
        return self._decrease()

    def _decrease(self) -> int:
        p = self.policy
        self.limit = max(p.min_concurrency, int(self.limit * p.decrease_factor))
        return self.limit


def stricter_tiers(tiers: tuple[Tier, ...], batch_tier: str) -> dict[str, Tier]:
    """The tiers the batch must not slow down: a lower engine priority value than the batch tier's."""
    mine = next(t.priority for t in tiers if t.name == batch_tier)
    return {t.name: t for t in tiers if t.priority < mine}


def slo_pressure(answers: list[dict], stricter: dict[str, Tier], since_ms: int) -> tuple[float, int]:
    """(worst latency/target, newest answer time) over stricter-tier answers newer than `since_ms`.

    `answers` are the gateways' recent outcomes (`{"tier", "t_ms", "ttft_ms",
    "tpot_ms", "slo_met", "status"}`); a missed SLO or a failed answer counts
    as 1.0 at least. Targets are the tiers' (a client may only tighten them).
    """
    worst, newest = 0.0, since_ms
    for a in answers:
        t_ms = int(a.get("t_ms") or 0)
        tier = stricter.get(a.get("tier", ""))
        if t_ms <= since_ms or tier is None:
            continue
        newest = max(newest, t_ms)
        ratio = max((a.get("ttft_ms") or 0.0) / tier.ttft_ms, (a.get("tpot_ms") or 0.0) / tier.tpot_ms)
        if not a.get("slo_met", True) or a.get("status", 200) != 200:
            ratio = max(ratio, 1.0)
        worst = max(worst, ratio)
    return worst, newest


def fleet_load(backlog: dict[str, int], stricter: dict[str, Tier], batch_tier: str,
               pressure: float = 0.0) -> FleetLoad:
    """A `FleetLoad` from the backlog hash (`<stage>:<tier>` -> tokens, every stage summed)
    and the SLO pressure; tiers looser than the batch tier are ignored."""
    stricter_tokens = batch_tokens = 0
    for field, tokens in backlog.items():
        tier = field.partition(":")[2]
        if tier == batch_tier:
            batch_tokens += max(0, tokens)
        elif tier in stricter:
            stricter_tokens += max(0, tokens)
    return FleetLoad(stricter_tokens, batch_tokens, pressure)
