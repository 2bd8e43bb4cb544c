"""Per-API-key rate limits: the GCRA policy, and one tenant flooding the gateway
while another keeps being served."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from skyline.scheduler.rate_limit import RateLimit, gcra
from tests.fleet import Fleet


def test_gcra_allows_a_burst_then_the_sustained_rate():
    limit = RateLimit(rate_per_s=2.0, burst=3)
    tat, allowed = None, []
    for _ in range(5):  # five at t=0: the burst of three passes
        d = gcra(limit, tat, 0.0)
        tat = d.tat_s
        allowed.append(d.allowed)
    assert allowed == [True, True, True, False, False]
    refused = gcra(limit, tat, 0.0)
    assert refused.retry_after_s == pytest.approx(0.5)
    assert gcra(limit, tat, 0.5).allowed  # one interval later, one more
    assert gcra(RateLimit(0.0), None, 0.0).allowed  # disabled


def test_gcra_refusal_does_not_consume_quota():
    limit = RateLimit(rate_per_s=1.0, burst=1)
    d1 = gcra(limit, None, 0.0)
    d2 = gcra(limit, d1.tat_s, 0.1)
    assert d1.allowed and not d2.allowed and d2.tat_s == d1.tat_s
    assert gcra(limit, d2.tat_s, 1.0).allowed


def test_a_flooding_tenant_gets_429_and_the_other_is_served(redis_url, key_prefix, tmp_path):
    (tmp_path / "keys.txt").write_text("# tenants\nkey-noisy\nkey-quiet  # the quiet one\n")
    (tmp_path / "cfg.toml").write_text(
        f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\nrate_limit_rps = 5.0\nrate_limit_burst = 5\n')
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    with fleet.running({"prefill-1": ("prefill",), "decode-1": ("decode",)}, timeout_s=60):
        def client(key):
            return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0, timeout=30)

        noisy, quiet = client("key-noisy"), client("key-quiet")

        def flood(_):
            try:
                noisy.completions.create(model="skyline-sim", prompt="spam", max_tokens=4)
                return 200
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("retry-after")
                assert exc.body["code"] == "rate_limit_exceeded"
                return 429

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            flood_results = pool.map(flood, range(100))
            quiet_ok = 0
            for _ in range(5):
                r = quiet.completions.create(model="skyline-sim", prompt="hello", max_tokens=4)
                quiet_ok += r.choices[0].finish_reason == "length"
                time.sleep(0.25)
            codes = list(flood_results)
        with pytest.raises(openai.AuthenticationError):
            client("key-unknown").completions.create(model="skyline-sim", prompt="x", max_tokens=1)
    assert quiet_ok == 5
    assert codes.count(429) >= 80 and codes.count(200) >= 5
