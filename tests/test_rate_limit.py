"""Per-API-key rate limits: the GCRA policy (requests, and tokens with a cost per
request), and one tenant flooding the gateway while another keeps being served."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from skyline.scheduler.rate_limit import RateLimit, charge, gcra, refund, token_budget
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


def test_a_token_budget_admits_prompts_up_to_a_minutes_worth_then_waits_for_the_refill():
    budget = token_budget(600)  # 10 tokens/s, 600 at once
    first = gcra(budget, None, 0.0, cost=400)
    second = gcra(budget, first.tat_s, 0.0, cost=200)  # exactly fills the minute
    assert first.allowed and second.allowed and second.tat_s == pytest.approx(60.0)
    third = gcra(budget, second.tat_s, 0.0, cost=50)
    assert not third.allowed and third.tat_s == second.tat_s  # refused: nothing used
    assert third.retry_after_s == pytest.approx(5.0)  # 50 tokens at 10/s
    assert not gcra(budget, second.tat_s, 4.9, cost=50).allowed
    assert gcra(budget, second.tat_s, 5.0, cost=50).allowed


def test_output_tokens_charged_at_the_end_put_the_key_in_debt():
    budget = token_budget(600)
    admitted = gcra(budget, None, 0.0, cost=100)
    in_debt = charge(budget, admitted.tat_s, 1.0, cost=1000)  # 1100 tokens used by t=1
    assert in_debt == pytest.approx(110.0)
    free = gcra(budget, in_debt, 1.0, cost=0)  # even a request of no tokens waits until the debt is paid
    assert not free.allowed and free.retry_after_s == pytest.approx(110.0 - 60.0 - 1.0)
    assert gcra(budget, in_debt, 50.0, cost=0).allowed
    assert not gcra(budget, in_debt, 50.0, cost=10).allowed and gcra(budget, in_debt, 51.0, cost=10).allowed


def test_a_request_larger_than_the_whole_budget_passes_when_the_key_is_idle():
    budget = token_budget(600)
    huge = gcra(budget, None, 0.0, cost=5000)  # never fits in 600, but the key owes nothing
    assert huge.allowed and huge.tat_s == pytest.approx(500.0)
    again = gcra(budget, huge.tat_s, 10.0, cost=5000)
    assert not again.allowed and again.retry_after_s == pytest.approx(490.0)  # until the key owes nothing
    assert gcra(budget, huge.tat_s, 500.0, cost=5000).allowed
    # Busy but not in debt: a huge request waits for idle, a small one that fits passes at once.
    some = gcra(budget, None, 0.0, cost=300).tat_s
    assert gcra(budget, some, 0.0, cost=200).allowed
    refused = gcra(budget, some, 0.0, cost=5000)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(30.0)


def test_a_refund_gives_back_an_admission_but_never_more_than_a_full_account():
    budget = token_budget(600)
    tat = gcra(budget, gcra(budget, None, 0.0, cost=300).tat_s, 0.0, cost=300).tat_s
    assert not gcra(budget, tat, 0.0, cost=300).allowed
    tat = refund(budget, tat, 0.0, cost=300)  # the second was refused further on: it used nothing
    assert tat == pytest.approx(30.0) and gcra(budget, tat, 0.0, cost=300).allowed
    assert refund(budget, tat, 40.0, cost=300) == 40.0  # the account refilled meanwhile: full, not beyond


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


def test_a_tenant_over_its_token_budget_gets_429_and_the_quiet_tenants_attainment_holds(redis_url, key_prefix,
                                                                                           tmp_path):
    budget = 3000  # tokens per minute for the noisy key: about 20 of its requests, then 50 tokens/s
    (tmp_path / "keys.txt").write_text(f"key-noisy tokens_per_minute={budget}\nkey-quiet\n"
                                       "key-capped strictest_tier=standard  # may not use interactive\n")
    (tmp_path / "cfg.toml").write_text(f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n')
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    with fleet.running({"prefill-1": ("prefill",), "decode-1": ("decode",)}, timeout_s=60):
        def client(key):
            return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0, timeout=60)

        noisy, quiet, capped = client("key-noisy"), client("key-quiet"), client("key-capped")

        def quiet_attainment() -> float:
            met = 0
            for i in range(8):
                r = quiet.completions.create(model="skyline-sim", prompt=f"hello {i}", max_tokens=8,
                                             extra_headers={"x-slo-tier": "interactive"})
                met += r.model_extra["skyline"]["slo_met"]
                time.sleep(0.2)
            return met / 8

        alone = quiet_attainment()
        stop = time.monotonic() + 600
        served_tokens, refusals = [], []

        def flood(_):
            while time.monotonic() < stop:
                try:
                    r = noisy.completions.create(model="skyline-sim", prompt="lorem ipsum " * 50, max_tokens=32)
                    served_tokens.append(r.usage.total_tokens)
                except openai.RateLimitError as exc:
                    refusals.append((exc.body["code"], exc.response.headers.get("retry-after")))

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            floods = [pool.submit(flood, i) for i in range(8)]
            time.sleep(1.0)  # the noisy key has spent its minute's worth by now
            flooded = quiet_attainment()
            stop = 0
            for f in floods:
                f.result()
        elapsed = time.monotonic() - t0

        with pytest.raises(openai.PermissionDeniedError) as denied:
            capped.completions.create(model="skyline-sim", prompt="x", max_tokens=1,
                                      extra_headers={"x-slo-tier": "interactive"})
        assert denied.value.body["code"] == "tier_not_allowed" and denied.value.body["param"] == "x-slo-tier"
        assert "it may use: standard, batch" in denied.value.body["message"]
        with pytest.raises(openai.PermissionDeniedError) as denied:  # asked for by a target that needs it
            capped.completions.create(model="skyline-sim", prompt="x", max_tokens=1,
                                      extra_body={"slo": {"ttft_ms": 800}})
        assert denied.value.body["param"] == "slo.ttft_ms"
        r = capped.completions.create(model="skyline-sim", prompt="x", max_tokens=1, extra_body={"slo": {"tier": "batch"}})
        assert r.model_extra["skyline"]["tier"] == "batch"
        assert capped.completions.create(model="skyline-sim", prompt="x", max_tokens=1).model_extra["skyline"]["tier"] \
            == "standard"

    assert alone == 1.0 and flooded >= alone - 1 / 8, (alone, flooded)  # within one request of running alone
    assert len(refusals) > 3 * len(served_tokens) and served_tokens
    assert {code for code, _ in refusals} == {"token_budget_exceeded"}
    assert all(after and int(after) >= 1 for _, after in refusals)
    # A minute's worth at once, the refill since, and what requests in flight used beyond their prompts.
    in_flight = 8 * max(served_tokens)
    assert sum(served_tokens) <= budget + budget / 60 * elapsed + in_flight, (sum(served_tokens), elapsed)
