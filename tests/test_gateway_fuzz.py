"""Hostile input: fuzzed request bodies, invalid UTF-8, huge headers.

The gateway runs with no live workers, so a request that passes validation
is answered 503 `no_workers` and one that does not gets a 4xx: either way an
OpenAI error JSON, never a 500, and nothing is ever enqueued.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyline.core.config import GatewayConfig, RedisConfig, SkylineConfig
from skyline.gateway.testing import GatewayThread, stream_lengths

MODEL = "sim-model"

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=10)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "stop", "stream", "stream_options", "seed", "logprobs", "echo", "best_of", "presence_penalty",
          "frequency_penalty", "response_format", "ignore_eos", "slo", "user", "tools", "tool_choice",
          "structured_outputs", "logit_bias", "top_logprobs", "prompt_logprobs", "min_tokens", "priority",
          "kv_transfer_params", "bad_words", "allowed_token_ids", "stop_token_ids", "truncate_prompt_tokens"]
plausible = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), values)},
    optional={f: st.one_of(values, st.just("hi"), st.just([{"role": "user", "content": "hi"}]),
                           st.integers(-5, 5000)) for f in FIELDS if f != "model"},
)
bodies = st.one_of(plausible, values)


@pytest.fixture(scope="module")
def gateway(redis_url):
    cfg = SkylineConfig(redis=RedisConfig(url=redis_url), gateway=GatewayConfig(max_body_bytes=20_000),
                        key_prefix="fuzz")
    with GatewayThread(cfg, None, MODEL, 256) as gw:
        yield gw, cfg
    assert all(n == 0 for n in stream_lengths(redis_url, cfg).values())


def assert_openai_error(resp: httpx.Response) -> None:
    assert resp.status_code in (400, 404, 413, 422, 503), (resp.status_code, resp.text)
    assert_openai_error_shape(resp)


def assert_openai_error_shape(resp: httpx.Response) -> None:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bodies_get_openai_errors_never_500(gateway, body, path):
    gw, _cfg = gateway
    content = json.dumps(body, allow_nan=True).encode()
    resp = httpx.post(gw.url + path, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert_openai_error(resp)


def test_invalid_utf8_body(gateway):
    gw, _ = gateway
    resp = httpx.post(gw.url + "/v1/completions", content=b'{"model": "sim-model", "prompt": "\xff\xfe\xfd"}',
                      headers={"content-type": "application/json"}, timeout=10)
    assert resp.status_code == 400
    assert_openai_error(resp)


def test_huge_headers_are_refused_and_the_gateway_keeps_serving(gateway):
    gw, _ = gateway
    resp = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                      headers={"x-junk": "a" * 200_000}, timeout=10)
    assert resp.status_code == 431
    assert_openai_error_shape(resp)
    assert httpx.get(gw.url + "/v1/models", timeout=5).status_code == 200
