"""SLO behaviour through the gateway on a sim fleet with a known prefill speed (1,000 tokens/s)."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import openai
import pytest

from tests.fleet import Fleet

MODEL = "skyline-sim"
SLOW_SIM = """
[engine]
sim_prefill_base_s = 0.0
sim_prefill_per_token_s = 0.001
sim_decode_base_s = 0.005
sim_decode_per_seq_s = 0.0
[worker]
prior_prefill_tokens_per_s = 1000.0
"""


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("slo-logs")
    cfg = logs / "slow.toml"
    cfg.write_text(SLOW_SIM)
    f = Fleet(redis_url, "e2e-slo", "sim", logs, ["--config", str(cfg)])
    with f.running({"prefill-slo": ("prefill",), "decode-slo": ("decode",)}, timeout_s=60):
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout_s=60)


def _interactive(client, prompt_tokens: int, demote: bool = False):
    headers = {"x-slo-tier": "interactive"}
    if demote:
        headers["x-slo-allow-demotion"] = "true"
    t0 = time.monotonic()
    try:
        # A distinct first block each: the sim engine caches prefixes, and a repeated prompt costs nothing.
        prompt = (uuid.uuid4().hex + "x" * prompt_tokens)[:prompt_tokens]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_headers=headers)
        return 200, time.monotonic() - t0, r.model_extra["skyline"], None
    except openai.APIStatusError as err:
        return err.status_code, time.monotonic() - t0, None, err


def test_5x_overload_is_shed_quickly_and_admitted_requests_meet_their_slo(client):
    # Capacity: 1,000 prompt tokens/s; interactive TTFT target 1 s; 200-token prompts:
    # about 4 fit in one second. Send 20 at once (5x).
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda _: _interactive(client, 200), range(20)))
    admitted = [r for r in results if r[0] == 200]
    shed = [r for r in results if r[0] == 429]
    assert len(admitted) + len(shed) == 20, [r[0] for r in results]
    assert 2 <= len(admitted) <= 8 and len(shed) >= 12
    for _status, elapsed, _ext, err in shed:
        assert elapsed < 1.0, "a shed request must be answered at once, not after queueing"
        assert int(err.response.headers["retry-after"]) >= 1
        assert err.body["code"] == "slo_unattainable"
    for _status, _elapsed, ext, _err in admitted:
        assert ext["admission"] == "admit" and ext["predicted_ttft_ms"] is not None
        assert ext["ttft_ms"] <= ext["slo_target"]["ttft_ms"], ext


def test_clients_that_allow_demotion_are_served_in_a_looser_tier(client):
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda _: _interactive(client, 200, demote=True), range(20)))
    assert all(r[0] == 200 for r in results), [r[0] for r in results]
    tiers = [r[2]["tier"] for r in results]
    assert "standard" in tiers and "interactive" in tiers
    demoted = [r[2] for r in results if r[2]["admission"] == "demote"]
    assert demoted and all(e["slo_target"]["ttft_ms"] == 5000 for e in demoted)


def test_requests_that_ask_for_no_slo_are_served_not_shed_as_vllm_serve_would(client):
    # ~10 s of prompts at once, past the default tier's 5 s target: a client that named no tier or
    # target is queued, not refused; each of them is answered.
    def plain(_):
        prompt = (uuid.uuid4().hex + "x" * 400)[:400]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        return r.model_extra["skyline"]

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        served = list(pool.map(plain, range(24)))
    assert all(ext["admission"] == "admit" for ext in served)
    assert max(ext["ttft_ms"] for ext in served) > 5_000  # some waited past the tier's target: not shed for it
