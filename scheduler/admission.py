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
one pool rate cannot price every prompt length (long prompts dominate the
rate, while a short chat prefills in one step, sooner than the rate says), and
an uncorrected model sheds requests that would have made it, or admits ones
that will not.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from skyline.scheduler.elastic import serves
from skyline.scheduler.tiers import Slo, Tier



@dataclass(frozen=True)
class AdmissionPolicy:
    prior_prefill_tokens_per_s: float = 1_000.0  # used until workers report a measurement
    first_token_overhead_ms: float = 150.0  # KV transfer + first decode step + fleet hops
    sheddable_tiers: tuple[str, ...] = ("interactive", "standard")  # may get 429; others always queue
    max_queued_tokens: int = 2_000_000  # hard bound on the prefill backlog: beyond it -> 503
    # Prompt tokens one decode-worker step carries. A prompt prefilled in the prefill pool gets its
    # first token in a step of a decode worker; while the decode workers compute prompts of their own,
    # that step carries up to this many prompt tokens besides (0: not modelled).
    decode_step_tokens: int = 0


class FleetLoad(NamedTuple):
    queued_tokens: Mapping[str, int]  # tier -> prompt tokens admitted and not yet prefilled
    prefill_tokens_per_s: float | None  # measured rate of the whole live pool; None = unknown
    prediction_scale: float = 1.0  # measured TTFT / predicted TTFT of recent requests (TtftCalibration)


class Decision:
    """One request's admission, made once per request (millions in a simulated hour): a slotted class,
    which the compiled simulator builds natively (a named tuple, or a frozen dataclass, is a Python
    call there); treat it as immutable."""

    __slots__ = ("action", "predicted_ttft_ms", "reason", "retry_after_s", "tier")

    def __init__(self, action: str, tier: str, predicted_ttft_ms: float, retry_after_s: int = 0,
                 reason: str = "") -> None:
        self.action = action  # "admit" | "demote" | "reject" | "overloaded"
        self.tier = tier  # tier the request goes to (demotion changes it)
        self.predicted_ttft_ms = predicted_ttft_ms
        self.retry_after_s = retry_after_s
        self.reason = reason

    def __repr__(self) -> str:
        return (f"Decision({self.action!r}, {self.tier!r}, {self.predicted_ttft_ms!r}, "
                f"retry_after_s={self.retry_after_s!r}, reason={self.reason!r})")


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
    return _admit(policy, tiers, tier, ttft_ms, prompt_tokens, load.queued_tokens, load.prefill_tokens_per_s,
                  load.prediction_scale, allow_demotion)


def _admit(policy: AdmissionPolicy, tiers: tuple[Tier, ...], tier: str, ttft_ms: int, prompt_tokens: int,
           queued: Mapping[str, int], rate: float | None, scale: float, allow_demotion: bool,
           wait_ms: float = 0.0) -> Decision:
    """`admit` on the load's parts (once per request in a simulated hour: 3.6 M times, so no records
    are built on the way to the common answer; the arithmetic is `tokens_ahead` and `_predict_ms`'s).
    `wait_ms`: a wait the request has on top of the first-token overhead in any tier (`handoff_wait_ms`)."""
    if sum(queued.values()) + prompt_tokens > policy.max_queued_tokens:
        return Decision("overloaded", tier, math.inf, retry_after_s=5, reason="prefill backlog is full")
    ahead = 0
    for name in _tiers_ahead(tiers, tier):
        ahead += queued.get(name, 0)
    rate = rate or policy.prior_prefill_tokens_per_s
    overhead_ms = policy.first_token_overhead_ms + wait_ms
    predicted = ((ahead + prompt_tokens) * 1000.0 / rate + overhead_ms) * scale
    # Nothing ahead: the request would be served first, so refusing it cannot help
    # anyone (and a too-pessimistic throughput estimate must not shed an idle fleet).
    if predicted <= ttft_ms or tier not in policy.sheddable_tiers or ahead == 0:
        return Decision("admit", tier, predicted)
    if allow_demotion:
        for looser in sorted((t for t in tiers if t.ttft_ms > ttft_ms), key=lambda t: t.ttft_ms):
            looser_ahead = sum(queued.get(name, 0) for name in _tiers_ahead(tiers, looser.name))
            p = ((looser_ahead + prompt_tokens) * 1000.0 / rate + overhead_ms) * scale
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
    would refuse requests that easily make their targets.
    An optimistic model shows in the prediction-error histogram instead.
    """

    weight: float = 0.1  # of each new measurement: ~10 requests to move most of the way
    lo: float = 0.5
    hi: float = 1.0
    _log_scale: dict[Hashable, float] = field(default_factory=dict)
    _scale: dict[Hashable, float] = field(default_factory=dict)  # exp of the above, read per request
    _log_lo: float = field(default=0.0, init=False, repr=False)  # log(lo), log(hi): the bounds are set once
    _log_hi: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._log_lo, self._log_hi = math.log(self.lo), math.log(self.hi)

    def observe(self, key: Hashable, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms <= 0 or measured_ms <= 0 or not math.isfinite(predicted_ms):
            return
        ratio = measured_ms / predicted_ms
        # The ratio clamped to [lo, hi]; at a bound (most requests of a fleet far from saturation),
        # its logarithm once for all.
        if ratio <= self.lo:
            log_ratio = self._log_lo
        elif ratio >= self.hi:
            log_ratio = self._log_hi
        else:
            log_ratio = math.log(ratio)
        old = self._log_scale.get(key, 0.0)
        new = old + self.weight * (log_ratio - old)
        if new != old or key not in self._scale:  # (a converged scale stays as it is)
            self._log_scale[key] = new
            self._scale[key] = math.exp(new)

    def scale(self, key: Hashable) -> float:
        return self._scale.get(key, 1.0)


# -- the gateway's rules around `admit`, shared by the live gateway and the simulator ------------------


def stage_of(route: str) -> str:
    """Where the request's prefill happens: colocated requests are prefilled by decode workers."""
    return "prefill" if route == "disagg" else "decode"


def pool_rate(workers: Iterable, stage: str) -> float | None:
    """Measured prefill tokens/s of the stage's live pool, from the workers' heartbeats (each with
    `.role` and `.tokens_per_s`, 0 = not measured yet; decode workers measure the prompts they compute
    themselves); None until some worker has measured one. Unmeasured workers count at the mean."""
    n, rates = 0, []
    for w in workers:
        if serves(w.role, stage):
            n += 1
            if w.tokens_per_s > 0:
                rates.append(w.tokens_per_s)
    return sum(rates) * n / len(rates) if rates else None


def decide(policy: AdmissionPolicy, tiers: tuple[Tier, ...], tier: str, ttft_ms: int, prompt_tokens: int,
           stage: str, backlog: Mapping[str, int], rate: float | None, calibration: TtftCalibration | None = None,
           allow_demotion: bool = False, handoff_ms: float = 0.0) -> tuple[Decision, float | None]:
    """One request's admission (of `tier`, its own TTFT target `ttft_ms`): `admit` on the stage's backlog
    and pool rate, its prediction scaled by
    the calibration of (stage, tier). `handoff_ms`: the wait for a busy decode worker's step after the
    prefill pool (`handoff_wait_ms`; 0 on the colocated route). Returns the decision and the unscaled
    model TTFT to learn from when the request ends (`learn_ttft`): only for an admission as asked (a
    demoted request's prediction was made for another tier; a refused one is never measured)."""
    scale = calibration._scale.get((stage, tier), 1.0) if calibration is not None else 1.0  # .scale(), inlined
    d = _admit(policy, tiers, tier, ttft_ms, prompt_tokens, backlog, rate, scale, allow_demotion, handoff_ms)
    return d, (d.predicted_ttft_ms / scale if d.action == "admit" else None)


def handoff_wait_ms(policy: AdmissionPolicy, tiers: tuple[Tier, ...], tier: str, decode_backlog: Mapping[str, int],
                    decode_rate: float | None) -> float:
    """How much longer a prompt prefilled in the prefill pool waits for its first token because the
    decode workers compute prompts of their own (`decode_backlog`: tier -> prompt tokens queued on them):
    the step that gives it its first token also carries up to `decode_step_tokens` of those prompts
    (only what EDF serves no later than `tier`; the engine runs looser tiers' prompts in smaller steps)."""
    if not policy.decode_step_tokens:
        return 0.0
    ahead = sum(decode_backlog.get(n, 0) for n in _tiers_ahead(tiers, tier))
    return min(ahead, policy.decode_step_tokens) * 1000.0 / (decode_rate or policy.prior_prefill_tokens_per_s)


def prefill_is_faster(policy: AdmissionPolicy, tiers: tuple[Tier, ...], tier: str, prefill_tokens: int,
                      decode_tokens: int, backlog: Mapping[str, Mapping[str, int]],
                      rates: Mapping[str, float | None], calibration: TtftCalibration | None = None) -> bool:
    """Would a short prompt's first token come sooner from the prefill pool than from the decode
    worker (scheduler/disagg.py `route`)? Admission's own model on each stage: the tokens of this tier
    and stricter queued ahead in it (`backlog`: stage -> tier -> tokens) plus its own (`prefill_tokens`
    / `decode_tokens`: what each stage's prefix caches leave to compute) over the stage's pool rate, plus
    the first-token overhead, scaled by the stage's calibration; from the prefill pool, plus the busy
    decode worker's step that gives the first token (`handoff_wait_ms`). Nothing queued ahead on the
    decode worker: False (computing it there moves no KV, and nothing waits)."""
    names = _tiers_ahead(tiers, tier)
    queued_d, queued_p = backlog.get("decode", {}), backlog.get("prefill", {})
    ahead_d = sum(queued_d.get(n, 0) for n in names)
    if ahead_d == 0:
        return False
    ahead_p = sum(queued_p.get(n, 0) for n in names)
    scales = calibration._scale if calibration is not None else {}
    prior = policy.prior_prefill_tokens_per_s

    def predicted(stage: str, ahead: int, tokens: int, wait_ms: float = 0.0) -> float:
        rate = rates.get(stage) or prior
        return (((ahead + tokens) * 1000.0 / rate + policy.first_token_overhead_ms + wait_ms)
                * scales.get((stage, tier), 1.0))

    wait = handoff_wait_ms(policy, tiers, tier, queued_d, rates.get("decode"))
    return predicted("prefill", ahead_p, prefill_tokens, wait) < predicted("decode", ahead_d, decode_tokens)


def demoted(slo: Slo, tier: Tier) -> Slo:
    """The SLO of a request demoted to `tier`: its TTFT target and priority; the TPOT target stays
    what was asked (demotion relaxes the first token only)."""
    return replace(slo, tier=tier.name, ttft_ms=tier.ttft_ms, priority=tier.priority)


def learn_ttft(calibration: TtftCalibration | None, route: str, tier: str, model_ttft_ms: float | None,
               ttft_ms: float | None) -> None:
    """Feed one finished request's measured TTFT back into the calibration of its (stage, tier):
    only requests `decide` gave a model TTFT for (None or 0: not learnt from)."""
    if calibration is None or not model_ttft_ms or ttft_ms is None:
        return
    calibration.observe((stage_of(route), tier), model_ttft_ms, ttft_ms)
