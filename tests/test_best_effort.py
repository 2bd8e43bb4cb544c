"""Requests that ask for no SLO (issue: a drop-in serves them as `vllm serve` would): pure and gateway-side."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from skyline.core import messages
from skyline.core.config import SkylineConfig
from skyline.core.streams import Claimed
from skyline.gateway.admission import apply_admission, best_effort_wait_s
from skyline.gateway.errors import ApiError
from skyline.gateway.metrics import GatewayMetrics
from skyline.gateway.prepare import Prepared, asks_for_slo
from skyline.scheduler.tiers import Slo
from skyline.workers.held import HeldRequest, Phase

RATE = 1_000.0  # prompt tokens/s of the one prefill worker


def _prep(best_effort: bool, prompt: int = 500) -> Prepared:
    req = messages.GenerateRequest("r", "m", [1] * prompt, messages.SamplingSpec(max_tokens=4), "standard", 0, 5_000,
                                   5_000, 500, priority=1, best_effort=best_effort)
    return Prepared("completion", req, Slo("standard", 5_000, 500, 1, 0), "disagg", False, False, 0, 0.0)


def _admit(prep: Prepared, queued_tokens: int, cfg: SkylineConfig | None = None) -> Prepared:
    cfg = cfg or SkylineConfig()
    cfg = replace(cfg, gateway=replace(cfg.gateway, ttft_calibration=False))
    fleet = SimpleNamespace(workers=[SimpleNamespace(role="prefill", tokens_per_s=RATE)])
    return apply_admission(cfg, cfg.admission_policy(), fleet, prep, {"standard": queued_tokens}, GatewayMetrics())


def test_a_request_that_asked_for_a_tier_is_shed_for_its_target_one_that_asked_for_nothing_is_not():
    # 20,000 tokens ahead at 1,000 tokens/s: ~20 s to the first token, past the standard tier's 5 s.
    with pytest.raises(ApiError) as refused:
        _admit(_prep(best_effort=False), 20_000)
    assert refused.value.status == 429 and refused.value.code == "slo_unattainable"
    admitted = _admit(_prep(best_effort=True), 20_000)
    assert admitted.admission == "admit" and admitted.predicted_ttft_ms > 20_000


def test_a_request_with_no_slo_is_refused_only_past_the_wait_bound_with_retry_after():
    cfg = SkylineConfig()
    assert best_effort_wait_s(cfg) == cfg.gateway.request_timeout_s  # 0 = the request timeout
    bounded = replace(cfg, gateway=replace(cfg.gateway, best_effort_max_wait_s=30.0))
    assert _admit(_prep(best_effort=True), 25_000, bounded).admission == "admit"
    with pytest.raises(ApiError) as refused:
        _admit(_prep(best_effort=True), 40_000, bounded)
    err = refused.value
    assert err.status == 429 and err.code == "queue_full" and int(err.headers["Retry-After"]) >= 1
    assert "best_effort_max_wait_s = 30 s" in err.message
    with pytest.raises(ApiError) as overloaded:  # the queue's own bound holds for every request
        _admit(_prep(best_effort=True), cfg.gateway.max_queued_tokens, bounded)
    assert overloaded.value.status == 503


def test_only_a_header_or_the_slo_field_asks_for_an_slo():
    def request(**headers):
        return SimpleNamespace(headers=headers)

    assert not asks_for_slo(request(), None)
    assert not asks_for_slo(request(**{"x-slo-tier": ""}), None)
    assert asks_for_slo(request(**{"x-slo-tier": "standard"}), None)
    assert asks_for_slo(request(**{"x-slo-ttft-ms": "900"}), None)
    assert asks_for_slo(request(), SimpleNamespace(tier=None, ttft_ms=None))


def test_no_tier_drops_a_request_that_asked_for_no_slo_for_lateness():
    from skyline.workers.runtime import WorkerRuntime
    from tests.test_rules_shared import _Engine, _config

    rt = WorkerRuntime(_config("decode"), _Engine(), "m")
    late = messages.GenerateRequest("r", "m", [1] * 10, messages.SamplingSpec(max_tokens=4), "standard", 0, 1, 1, 1)
    for best_effort, dropped in ((False, True), (True, False)):
        held = HeldRequest.of(Claimed("s", "0-1", "standard", messages.DecodeWork(replace(late, best_effort=best_effort))),
                              Phase.COMPUTING)
        assert rt._too_late(held) is dropped


def test_the_pace_rule_holds_streams_only_to_targets_someone_asked_for():
    from skyline.scheduler.decode_room import pace_allows, tightest_target_ms

    assert tightest_target_ms([(500, True), (500, True)]) is None  # best effort only: no target
    assert pace_allows(0.6, tightest_target_ms([(500, True), (500, True)]), 0.9)  # slow streams, still claims
    assert tightest_target_ms([(500, True), (250, False)]) == 250
    assert not pace_allows(0.6, tightest_target_ms([(100, True), (500, False)]), 0.9)  # 600 ms > 0.9 x 500
