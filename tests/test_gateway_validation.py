"""Gateway input validation against a real Redis: every bad request gets the right OpenAI
error and leaves the queues untouched; a fleet without workers is refused fast."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import openai
import pytest

from skyline.core.config import GatewayConfig, RedisConfig, SkylineConfig
from skyline.core.keys import Keys
from skyline.gateway.testing import GatewayThread, announce_workers, stream_lengths

MODEL = "sim-model"
MAX_MODEL_LEN = 256  # SimTokenizer: one token per UTF-8 byte


def make_cfg(redis_url: str, key_prefix: str, **gateway: object) -> SkylineConfig:
    gw = replace(GatewayConfig(), max_body_bytes=20_000, worker_liveness_s=600, **{"min_remote_prefill_tokens": 0, **gateway})
    return SkylineConfig(redis=RedisConfig(url=redis_url), gateway=gw, key_prefix=key_prefix)


def register_workers(redis_url: str, keys: Keys, *roles: str) -> None:
    announce_workers(redis_url, keys, *roles, model=MODEL)


def assert_nothing_enqueued(redis_url: str, cfg: SkylineConfig) -> None:
    lengths = stream_lengths(redis_url, cfg)
    assert all(n == 0 for n in lengths.values()), lengths


@pytest.fixture
def gateway(redis_url, key_prefix):
    cfg = make_cfg(redis_url, key_prefix)
    register_workers(redis_url, Keys(key_prefix), "prefill", "decode")
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:
        yield gw
    assert_nothing_enqueued(redis_url, cfg)


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_malformed_json(gateway):
    resp = httpx.post(gateway.url + "/v1/completions", content=b'{"model": "sim-model", "prompt": ',
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
])
def test_missing_fields(gateway, path, body, field):
    resp = httpx.post(gateway.url + path, json=body)
    assert resp.status_code == 400  # vLLM's request models refuse it, with vLLM's message
    err = resp.json()["error"]
    assert field in (err["param"] or "") and field in err["message"]


def test_body_that_is_not_an_object(gateway):
    resp = httpx.post(gateway.url + "/v1/completions", json=["a"])
    assert resp.status_code == 400 and "JSON object" in resp.json()["error"]["message"]


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as ei:  # as vllm serve answers it
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    err = error_of(ei.value)
    assert MODEL in err["message"] and "gpt-4" in err["message"]


def test_max_tokens_zero(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert error_of(ei.value)["param"] == "max_tokens"


def test_prompt_longer_than_context(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="y" * (MAX_MODEL_LEN + 10))
    err = error_of(ei.value)
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN) in err["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_values(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:  # vLLM's checks, before anything is queued
        client.completions.create(model=MODEL, prompt="hi", **kwargs)
    err = error_of(ei.value)
    assert param in (err["param"] or "") or param in err["message"]


def test_chat_options_this_gateway_is_not_configured_for(client):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as ei:  # vllm serve without --enable-auto-tool-choice
        client.chat.completions.create(model=MODEL, messages=msgs, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], tool_choice="auto")
    assert "--enable-auto-tool-choice" in error_of(ei.value)["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert ei.value.status_code == 400


def test_oversized_body(gateway, client):
    resp = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "z" * 30_000})
    assert resp.status_code == 413
    assert "20000" in resp.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as ei:
        client.completions.create(model=MODEL, prompt="z" * 30_000)
    assert ei.value.status_code == 413


def test_oversized_body_without_content_length(gateway):
    def chunks():
        yield b'{"model": "sim-model", "prompt": "'
        for _ in range(30):
            yield b"w" * 1000
        yield b'"}'

    resp = httpx.post(gateway.url + "/v1/completions", content=chunks())  # chunked: no Content-Length
    assert resp.status_code == 413


def test_unknown_slo_tier(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", extra_headers={"x-slo-tier": "platinum"})
    err = error_of(ei.value)
    assert "platinum" in err["message"] and "interactive" in err["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"slo": {"tier": "gold"}})
    assert "gold" in error_of(ei.value)["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", extra_headers={"x-slo-ttft-ms": "soon"})
    assert error_of(ei.value)["param"] == "x-slo-ttft-ms"


def test_bad_route_header(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", extra_headers={"x-skyline-route": "sideways"})
    assert error_of(ei.value)["param"] == "x-skyline-route"


def test_api_keys(redis_url, key_prefix):
    cfg = make_cfg(redis_url, key_prefix, api_keys=("sk-right",))
    register_workers(redis_url, Keys(key_prefix), "prefill", "decode")
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:
        for key in ("sk-wrong", "Bearer sk-right"):
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as ei:
                client.completions.create(model=MODEL, prompt="hi")
            assert error_of(ei.value)["type"] == "authentication_error"
        resp = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert resp.status_code == 401 and "Bearer" in resp.json()["error"]["message"]
        assert httpx.get(gw.url + "/v1/models").status_code == 401
        ok = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-right", max_retries=0)
        assert [m.id for m in ok.models.list()] == [MODEL]
        assert httpx.get(gw.url + "/health").status_code == 200  # probes need no key
    assert_nothing_enqueued(redis_url, cfg)


@pytest.mark.parametrize("mode, route_header, missing", [
    ("disagg", None, "prefill"),
    ("colocated", None, "decode"),
    ("disagg", "colocated", "decode"),
])
def test_no_workers_is_503_fast(redis_url, key_prefix, mode, route_header, missing):
    cfg = make_cfg(redis_url, key_prefix, mode=mode)
    if missing == "prefill":
        register_workers(redis_url, Keys(key_prefix), "decode")  # decode alone is not enough for disagg
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        headers = {"x-skyline-route": route_header} if route_header else {}
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as ei:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_headers=headers)
        assert time.monotonic() - t0 < 2.0
        assert ei.value.status_code == 503
        assert f"skyline worker {missing}" in error_of(ei.value)["message"]
    assert_nothing_enqueued(redis_url, cfg)


def test_models_and_health(gateway, client):
    models = client.models.list()
    assert [(m.id, m.owned_by) for m in models] == [(MODEL, "vllm")]  # vLLM's own /v1/models
    health = httpx.get(gateway.url + "/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["workers"] == {"prefill": 1, "decode": 1}
    metrics = httpx.get(gateway.url + "/metrics")
    assert metrics.status_code == 200 and "skyline_gateway_requests" in metrics.text


def test_unknown_route_is_openai_404(gateway):
    resp = httpx.get(gateway.url + "/v1/nothing")
    assert resp.status_code == 404 and "error" in resp.json()


def test_health_503_when_redis_is_down(key_prefix, tmp_path):
    from skyline.core.net import free_port
    from skyline.tools.redis_server import start_redis

    port = free_port()
    proc = start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    cfg = make_cfg(url, key_prefix)
    register_workers(url, Keys(key_prefix), "prefill", "decode")
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:
        assert httpx.get(gw.url + "/health").status_code == 200
        proc.terminate()
        proc.wait(timeout=10)
        resp = httpx.get(gw.url + "/health", timeout=5)
        assert resp.status_code == 503
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model=MODEL, prompt="hi")
        assert ei.value.status_code == 503
