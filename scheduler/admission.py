"""Admission control: will this request meet its TTFT target given the work ahead of it?

The gateway asks before enqueueing. The prediction is deliberately simple and
explainable (operators must be able to reason about a 429):

  predicted TTFT = (prefill tokens admitted ahead of it, queued or in progress + its own)
                   / prefill throughput of the live pool
                   + fixed first-token overhead (transfer, first decode step)

"Ahead" means work the EDF order serves first: every unfinished prefill token
of tiers whose TTFT target is at most this request's (their deadlines come
first). Looser tiers' backlog is not ahead: EDF serves it after, and
fleet-level preemption removes it from the engine when it would make this
request late.

The prediction is then scaled by its own measured error (`TtftCalibration`):
one pool rate cannot price every prompt length (measured on CPU: the rate is
~800 tokens/s over a mix dominated by long prompts, while a 250-token chat
prefills in one ~130 ms step), and an uncorrected model sheds requests that
would have made it, or admits ones that will not.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from skyline.scheduler.tiers import Tier


@dataclass(frozen=True)
class AdmissionPolicy:
    prior_prefill_tokens_per_s: float = 1_000.0  # used until workers report a measurement
    first_token_overhead_ms: float = 150.0  # KV transfer + first decode step + fleet hops
    sheddable_tiers: tuple[str, ...] = ("interactive", "standard")  # may get 429; others always queue
    max_queued_tokens: int = 2_000_000  # hard bound on the prefill backlog: beyond it -> 503


# FleetLoad and Decision are immutable records made once per request (millions in a simulated
# hour): named tuples, which build several times faster than frozen dataclasses.
class FleetLoad(NamedTuple):
    queued_tokens: Mapping[str, int]  # tier -> prompt tokens admitted and not yet prefilled
    prefill_tokens_per_s: float | None  # measured rate of the whole live pool; None = unknown
    prediction_scale: float = 1.0  # measured TTFT / predicted TTFT of recent requests (TtftCalibration)


class Decision(NamedTuple):
    action: str  # "admit" | "demote" | "reject" | "overloaded"
    tier: str  # tier the request goes to (demotion changes it)
    predicted_ttft_ms: float
    retry_after_s: int = 0
    reason: str = ""


_AHEAD: dict[tuple[int, str], tuple[tuple[Tier, ...], tuple[str, ...]]] = {}


def _tiers_ahead(tiers: tuple[Tier, ...], tier: str) -> tuple[str, ...]:
    """The tiers EDF serves no later than `tier`; memoised by the identity of `tiers` (a config's
    tuple lives as long as the config; hashing its dataclasses on every request cost more)."""
    hit = _AHEAD.get((id(tiers), tier))
    if hit is not None and hit[0] is tiers:
        return hit[1]
    limit = {t.name: t.ttft_ms for t in tiers}[tier]  # an unknown tier is a KeyError
    names = tuple(t.name for t in tiers if t.ttft_ms <= limit)
    if len(_AHEAD) > 256:
        _AHEAD.clear()
    _AHEAD[(id(tiers), tier)] = (tiers, names)
    return names


def tokens_ahead(tiers: tuple[Tier, ...], tier: str, load: FleetLoad) -> int:
    """Prefill tokens EDF serves before a new request of `tier`: its own and stricter tiers'."""
    queued = load.queued_tokens
    return sum(queued.get(name, 0) for name in _tiers_ahead(tiers, tier))


def predict_ttft_ms(policy: AdmissionPolicy, tiers: tuple[Tier, ...], tier: str, prompt_tokens: int, load: FleetLoad) -> float:
    return _predict_ms(policy, tokens_ahead(tiers, tier, load), prompt_tokens, load)


def _predict_ms(policy: AdmissionPolicy, ahead: int, prompt_tokens: int, load: FleetLoad) -> float:
    rate = load.prefill_tokens_per_s or policy.prior_prefill_tokens_per_s
    return ((ahead + prompt_tokens) * 1000.0 / rate + policy.first_token_overhead_ms) * load.prediction_scale


def admit(
    policy: AdmissionPolicy, tiers: tuple[Tier, ...], tier: str, ttft_ms: int, prompt_tokens: int,
    load: FleetLoad, allow_demotion: bool = False,
) -> Decision:
    """Admit, demote to the next looser tier, or refuse.

    `ttft_ms` is the request's own (possibly tightened) target. A refusal of
    a sheddable tier is a 429 whose Retry-After is the time the backlog needs
    to shrink enough; a backlog past `max_queued_tokens` is a 503 for any
    tier, so overload never means an unbounded queue.
    """
    if sum(load.queued_tokens.values()) + prompt_tokens > policy.max_queued_tokens:
        return Decision("overloaded", tier, math.inf, retry_after_s=5, reason="prefill backlog is full")
    ahead = tokens_ahead(tiers, tier, load)
    predicted = _predict_ms(policy, ahead, prompt_tokens, load)
    # Nothing ahead: the request would be served first, so refusing it cannot help
    # anyone (and a too-pessimistic throughput estimate must not shed an idle fleet).
    if predicted <= ttft_ms or tier not in policy.sheddable_tiers or ahead == 0:
        return Decision("admit", tier, predicted)
    if allow_demotion:
        for looser in sorted((t for t in tiers if t.ttft_ms > ttft_ms), key=lambda t: t.ttft_ms):
            p = predict_ttft_ms(policy, tiers, looser.name, prompt_tokens, load)
            if p <= looser.ttft_ms or looser.name not in policy.sheddable_tiers:
                return Decision("demote", looser.name, p, reason=f"demoted from {tier}: predicted TTFT {predicted:.0f} ms")
    retry = max(1, math.ceil((predicted - ttft_ms) / 1000.0))
    return Decision(
        "reject", tier, predicted, retry_after_s=retry,
        reason=f"predicted time to first token {predicted:.0f} ms exceeds the {tier} target of {ttft_ms} ms",
    )


@dataclass
class TtftCalibration:
    """Admission control's measured error, fed back into its predictions.

    For each key (the gateway uses (stage, tier): prompts of one tier tend to be
    alike, and the routes differ by a KV transfer), the scale is an exponentially
    weighted geometric mean of measured / predicted TTFT over admitted requests,
    clamped to [lo, hi]. Only admitted requests are measured; too pessimistic a
    scale admits more requests, whose measured TTFT pulls it back up.

    `hi` is 1 on purpose: the calibration may only take pessimism out of the
    model, never add refusals to it. Measured TTFTs far above the predictions
    come from causes the next request does not share as often as not (a cold
    engine's first requests, a host stall): scaled up by them, the model
    refused six 5-token prompts against a 5 s target in the real-engine tests.
    An optimistic model shows in the prediction-error histogram instead.
    """

    weight: float = 0.1  # of each new measurement: ~10 requests to move most of the way
    lo: float = 0.5
    hi: float = 1.0
    _log_scale: dict[Hashable, float] = field(default_factory=dict)
    _scale: dict[Hashable, float] = field(default_factory=dict)  # exp of the above, read per request

    def observe(self, key: Hashable, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms <= 0 or measured_ms <= 0 or not math.isfinite(predicted_ms):
            return
        ratio = min(max(measured_ms / predicted_ms, self.lo), self.hi)
        old = self._log_scale.get(key, 0.0)
        self._log_scale[key] = new = old + self.weight * (math.log(ratio) - old)
        self._scale[key] = math.exp(new)

    def scale(self, key: Hashable) -> float:
        return self._scale.get(key, 1.0)
