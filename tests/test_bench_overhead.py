"""`skyline bench overhead` end to end: the fleet against its baseline, vLLM's own server over an instant engine.

Real processes (Redis, gateway, sim workers at zero latency, and
`skyline.tools.bench.instant_vllm`). Asserts what the report's reader relies on:
both systems answered every request of both endpoints, the added TTFT is the
difference of the two medians, and the gateway's breakdown of its own TTFT is
there; and that the baseline is vLLM's server, answering as `vllm serve` does.
"""

from __future__ import annotations

import math

import httpx
import pytest

from skyline.tools.bench import overhead


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return overhead.run(n_latency=12, concurrency=2, duration_s=1.0, max_tokens=8, tracing=True)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_both_systems_answer_and_the_difference_is_reported(result, kind):
    lat = result["added_latency"][kind]
    assert lat["skyline"]["ok"] == 12 and lat["vllm"]["ok"] == 12
    assert lat["added_ttft_p50_ms"] == pytest.approx(lat["skyline"]["ttft_p50_ms"] - lat["vllm"]["ttft_p50_ms"],
                                                     abs=0.002)
    parts = lat["skyline"]["gateway_p50_ms"]
    assert set(parts) == {"render_ms", "enqueue_ms", "fleet_first_token_ms"}
    assert all(v is not None and 0 < v < lat["skyline"]["ttft_p50_ms"] for v in parts.values())


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_traced_fleet_takes_its_turns_and_exports_its_spans(result, kind):
    lat = result["added_latency"][kind]
    assert lat[overhead.TRACED]["ok"] == 12
    assert lat["tracing_added_ttft_p50_ms"] == pytest.approx(
        lat[overhead.TRACED]["ttft_p50_ms"] - lat["skyline"]["ttft_p50_ms"], abs=0.002)
    assert result["tracing"]["spans_received"] > 0 and "skyline-gateway" in result["tracing"]["services"]


def test_throughput_phase_runs_on_the_fleet(result):
    tp = result["throughput"]
    assert tp["requests_ok"] > 0 and tp["requests_failed"] == 0 and math.isfinite(tp["streamed_tokens_per_s"])


def test_the_baseline_is_vllms_server(tmp_path):
    proc, url = overhead._start_baseline(tmp_path)
    try:
        body = {"model": "skyline-sim", "prompt": "hi", "max_tokens": 3}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=10).json()
        assert resp["choices"][0]["text"] == "xxx" and resp["usage"]["completion_tokens"] == 3
        assert resp["system_fingerprint"].startswith("vllm-")  # vLLM's serving code answered
        bad = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": -1}, timeout=10)
        assert bad.status_code == 400 and "max_tokens" in bad.text  # vLLM's own validation
    finally:
        overhead._stop(proc)
