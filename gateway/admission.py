"""The gateway's side of admission control: gather the fleet's load, ask the policy, act.

The decision itself is `skyline.scheduler.admission.decide` (pure: `admit` with the
calibration's scale; `demoted`, `learn_ttft`, `pool_rate` and `stage_of` live there too, shared
with the simulator; the policy's numbers are `SkylineConfig.admission_policy()`). Here: the
backlog comes from the `skyline:backlog` hash, read right after this request's tokens
were reserved in it (so a burst sees itself; gateway/dispatch.py sends both with the
cache-view reads, in one round trip), the measured
prefill throughput from the heartbeats the FleetView caches, and the scale
for the prediction from this gateway's own measured error (`TtftCalibration`,
fed by `learn` when an admitted request ends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from skyline.core import messages
from skyline.core.config import SkylineConfig
from skyline.gateway.errors import ApiError
from skyline.gateway.fleetview import ModelView
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.prepare import Prepared
from skyline.scheduler.admission import (
    AdmissionPolicy, TtftCalibration, decide, demoted, learn_ttft, pool_rate, stage_of,
)


def apply_admission(
    cfg: SkylineConfig, policy: AdmissionPolicy, fleet: ModelView, prep: Prepared, backlog: Mapping[str, int],
    metrics: GatewayMetrics, calibration: TtftCalibration | None = None, handoff_ms: float = 0.0,
) -> Prepared:
    """The request as it may be enqueued (possibly demoted), decided on `backlog` (tier -> tokens
    queued in its stage, read while its own prompt was reserved: `skyline.core.streams.queue_reservation`;
    `handoff_ms`: on the disaggregated route, the wait for a busy decode worker's step,
    `skyline.scheduler.admission.handoff_wait_ms`); or an ApiError (429/503). No I/O: the dispatcher
    releases the reservation of a refused request, and the enqueue moves a demoted one's to its new tier."""
    req = prep.request
    stage, tokens = stage_of(prep.route), prep.prefill_tokens  # what its prefix cache does not hold
    # A request that asked for no SLO is held to no TTFT target, only to the wait it may take.
    target_ms = int(best_effort_wait_s(cfg) * 1000) if req.best_effort else req.ttft_ms
    d, model_ttft_ms = decide(policy, cfg.tiers, req.tier, target_ms, tokens, stage, backlog,
                              pool_rate(fleet.workers, stage), calibration, prep.allow_demotion and not req.best_effort,
                              handoff_ms)
    metrics.admission.labels(req.model, req.tier, d.action).inc()
    if d.action == "reject" and req.best_effort:
        raise ApiError(429, f"the queue ahead would hold this request (it asks for no SLO) about "
                            f"{d.predicted_ttft_ms / 1000:.0f} s before its first token, past [gateway] "
                            f"best_effort_max_wait_s = {best_effort_wait_s(cfg):g} s; retry later",
                       type="rate_limit_error", code="queue_full", headers={"Retry-After": str(d.retry_after_s)})
    if d.action == "reject":
        raise ApiError(429, f"{d.reason}; retry later or send x-slo-allow-demotion: true to accept a looser tier",
                       type="rate_limit_error", code="slo_unattainable", headers={"Retry-After": str(d.retry_after_s)})
    if d.action == "overloaded":
        raise ApiError(503, f"Skyline is overloaded: {d.reason}", code="overloaded",
                       headers={"Retry-After": str(d.retry_after_s)})
    if d.action == "demote":
        slo = demoted(prep.slo, cfg.tier(d.tier))  # the TTFT target relaxes; the TPOT target stays
        req = replace(req, tier=slo.tier, ttft_ms=slo.ttft_ms, priority=slo.priority,
                      deadline_ms=req.arrival_ms + slo.ttft_ms)
        return replace(prep, request=req, slo=slo, admission="demote", predicted_ttft_ms=d.predicted_ttft_ms)
    return replace(prep, predicted_ttft_ms=d.predicted_ttft_ms, model_ttft_ms=model_ttft_ms)


def best_effort_wait_s(cfg: SkylineConfig) -> float:
    """The longest predicted wait a request with no SLO is admitted for (`[gateway] best_effort_max_wait_s`)."""
    return cfg.gateway.best_effort_max_wait_s or cfg.gateway.request_timeout_s


def learn(calibration: TtftCalibration, session: Any, status: int, fin: messages.Finished | None) -> None:
    """Session.close hook: an admitted request's measured TTFT against the model's prediction
    (a demoted request is not measured: its prediction was made for another tier)."""
    prep = session.prep
    if fin is None or status != 200 or prep.model_ttft_ms is None:
        return
    ttft_s = session.ttft_s()
    if ttft_s is not None:
        learn_ttft(calibration, prep.route, prep.slo.tier, prep.model_ttft_ms, ttft_s * 1000)
