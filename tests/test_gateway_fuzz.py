"""Hostile input: fuzzed request bodies, headers and `slo` extensions, invalid UTF-8 and Unicode, deep
nesting, huge headers, out-of-vocabulary token ids, a chat template that fails.

Two gateways. `gateway` has no live workers: a request that passes validation is answered 503
`no_workers`, one that does not gets a 4xx, and nothing is ever enqueued. `served` has a sim fleet
behind it (in process), so a fuzzed request that passes validation is served for real, through SLO
resolution, admission, Redis and the workers: every answer there is a success or a 4xx in the
OpenAI error shape, never a 5xx, and never a hang (every call has a client timeout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from dataclasses import replace

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from skyline.core.config import GatewayConfig, RedisConfig, SkylineConfig
from skyline.gateway.testing import GatewayThread, stream_lengths
from skyline.workers.engines.sim import SimTiming
from tests.inprocess import start_fleet, stop_fleet, wait_registered

MODEL = "sim-model"
VOCAB = 259  # the sim model's byte tokenizer: ids 0-255 bytes, 256 EOS, 257/258 think markers
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"]
API_KEY = "fuzz-key"  # the served gateway checks keys, so the fuzzed `authorization` header is checked too
FAST = SimTiming(prefill_base_s=0.001, prefill_per_token_s=0.0, decode_base_s=0.001, decode_per_seq_s=0.0)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

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

# Numbers as a client may spell them where Skyline reads milliseconds, a tier or a flag.
hostile_numbers = st.one_of(
    st.sampled_from(["inf", "-inf", "Infinity", "nan", "NaN", "1e400", "-1e400", "1e300", "1e-300", "0", "-0", "-1",
                     "0.5", "250", "60000", "0x10", "1_000", "5ms", ""]),
    st.integers(-2**80, 2**80).map(str), st.floats().map(repr))
header_words = st.sampled_from(["interactive", "standard", "batch", "INTERACTIVE", "true", "yes", "1", "false",
                                "disagg", "colocated", f"Bearer {API_KEY}", "Bearer", "Bearer wrong", "Basic Zm9v",
                                "{decode}", "*", "a:b", "../x"])
latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"), max_size=40)
# HTTP strips the whitespace around a header value (httpx refuses to send it): the server never sees it.
header_values = st.one_of(hostile_numbers, header_words, latin1.map(str.strip),
                          st.integers(100, 12_000).map(lambda n: "9" * n))
# Every header Skyline reads (gateway/prepare.py, gateway/tenants.py), and those vLLM's serving code reads.
HEADERS = ["x-slo-tier", "x-slo-ttft-ms", "x-slo-tpot-ms", "x-slo-allow-demotion", "x-skyline-route", "authorization",
           "x-request-id", "x-data-parallel-rank", "x-session-id", "traceparent"]
headers = st.dictionaries(st.sampled_from(HEADERS), header_values, max_size=3)

# Skyline's `slo` body extension (gateway/prepare.py SloSpec), its real fields and one it does not have.
slo_values = st.one_of(scalars, values, st.integers(-2**80, 2**80), st.integers(10**300, 10**301),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2_000))
slos = st.one_of(values, st.fixed_dictionaries({}, optional={
    "tier": st.sampled_from(["interactive", "standard", "batch"]) | slo_values,
    "ttft_ms": st.integers(1, 100_000) | slo_values, "tpot_ms": st.integers(1, 10_000) | slo_values,
    "allow_demotion": st.booleans() | slo_values, "deadline_ms": slo_values}))

# Body fields for the served gateway, each either a value it takes or a hostile one; few and short
# outputs (`n`, `max_tokens` stay small) so that the fleet answers quickly.
SERVED_FIELDS = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": ["x"],
                 "stop_token_ids": [10], "logprobs": 2, "top_logprobs": 2, "logit_bias": {"104": 5},
                 "allowed_token_ids": [104, 105], "bad_words": ["x"], "min_tokens": 1, "presence_penalty": 0.5,
                 "frequency_penalty": 0.5, "repetition_penalty": 1.1, "ignore_eos": True, "echo": True,
                 "stream_options": {"include_usage": True}, "response_format": {"type": "json_object"},
                 "user": "u", "request_id": "r-1", "n": 2, "max_tokens": 3, "prompt": [104, 105]}
hostile_values = st.one_of(values, st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                           st.text(st.characters(), max_size=20))  # lone surrogates included


def _field_value(field: str):
    bounded = st.integers(-2, 4) if field in ("n", "max_tokens") else hostile_values
    return st.one_of(st.just(SERVED_FIELDS[field]), bounded)


served_fields = st.sampled_from(sorted(SERVED_FIELDS)).flatmap(
    lambda f: _field_value(f).map(lambda v: {f: v})) | st.just({})
served_field_sets = st.lists(served_fields, max_size=3).map(lambda ds: {k: v for d in ds for k, v in d.items()})


@pytest.fixture(scope="module")
def gateway(redis_url):
    cfg = SkylineConfig(redis=RedisConfig(url=redis_url), gateway=GatewayConfig(max_body_bytes=20_000),
                        key_prefix="fuzz")
    with GatewayThread(cfg, None, MODEL, 256) as gw:
        yield gw, cfg
    assert all(n == 0 for n in stream_lengths(redis_url, cfg).values())


@pytest.fixture(scope="module")
def served(redis_url):
    """A gateway over a prefill and a decode sim worker; the workers run on an event loop of their
    own, so the (synchronous) Hypothesis tests can call the gateway while they serve."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-fleet", daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    prefix = f"fuzz-{uuid.uuid4().hex[:8]}"
    cfg, r, runtimes, tasks = run(start_fleet(redis_url, prefix, FAST, "fuzz"))
    try:
        run(wait_registered(r, prefix))
        cfg = replace(cfg, gateway=replace(cfg.gateway, api_keys=(API_KEY,)))
        with GatewayThread(cfg, None, MODEL, 256) as gw:
            yield gw
    finally:
        run(stop_fleet(r, runtimes, tasks))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def assert_openai_error(resp: httpx.Response) -> None:
    assert resp.status_code in (400, 404, 413, 422, 503), (resp.status_code, resp.text)
    assert_openai_error_shape(resp)


def assert_openai_error_shape(resp: httpx.Response) -> None:
    """OpenAI's error shape, or the Messages API's on its route (`{"type": "error", "error": {type, message}}`)."""
    body = resp.json()
    err = body["error"]
    anthropic = body.get("type") == "error" and set(err) == {"type", "message"}
    assert (anthropic or set(err) == {"message", "type", "param", "code"}) and err["message"]


def assert_served_or_refused(resp: httpx.Response) -> None:
    """A success (a stream with no error event) or a 4xx in the OpenAI shape."""
    if resp.status_code == 200:
        if resp.headers["content-type"].startswith("text/event-stream"):
            events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events, resp.text[-500:]
            done = [json.loads(e) for e in events if e != "[DONE]"]
            assert not [e for e in done if "error" in e or e.get("type") in ("error", "response.failed")], \
                resp.text[-500:]
        else:
            body = resp.json()
            assert body.get("choices") or body.get("status") in ("completed", "incomplete") \
                or body.get("type") == "message", resp.text  # chat/completion, responses, messages
        return
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    assert_openai_error_shape(resp)


def small_request(path: str, stream: bool, **fields) -> dict:
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream,
                **fields}
    if path == "/v1/messages":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream,
                **fields}
    if path == "/v1/responses":
        return {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False, "stream": stream, **fields}
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream, **fields}


def post_served(gw, path: str, body: dict | str, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST with the API key unless `headers` sends its own `authorization`; header values go as
    Latin-1 bytes (what HTTP carries and Starlette decodes), so any of those characters can be sent."""
    sent = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json", **(headers or {})}
    content = body if isinstance(body, str) else json.dumps(body, allow_nan=True)
    return httpx.post(gw.url + path, content=content.encode(), timeout=15,
                      headers=[(k.encode(), v.encode("latin-1")) for k, v in sent.items()])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bodies_get_openai_errors_never_500(gateway, body, path):
    gw, _cfg = gateway
    content = json.dumps(body, allow_nan=True).encode()
    resp = httpx.post(gw.url + path, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert_openai_error(resp)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions/batch", "/invocations", "/v1/messages"]))
def test_fuzzed_bodies_on_the_other_generation_routes_never_500(gateway, body, path):
    gw, _cfg = gateway
    content = json.dumps(body, allow_nan=True).encode()
    resp = httpx.post(gw.url + path, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert resp.status_code in (400, 404, 413, 422, 503), (resp.status_code, resp.text)
    err = resp.json()["error"]  # OpenAI's shape, or the Messages API's ({"type": "error", "error": {...}})
    assert err["message"] and (set(err) == {"message", "type", "param", "code"} or set(err) == {"type", "message"})


@FUZZ
@given(sent=headers, path=st.sampled_from(PATHS), stream=st.booleans())
@example(sent={"x-slo-tier": "inf", "x-session-id": "inf"}, path="/v1/responses", stream=True)  # found in CI: a 500
def test_fuzzed_headers_are_served_or_refused_never_500(served, sent, path, stream):
    assert_served_or_refused(post_served(served, path, small_request(path, stream), sent))


@FUZZ
@given(slo=slos, sent=st.dictionaries(st.sampled_from(["x-slo-tier", "x-slo-ttft-ms", "x-slo-allow-demotion"]),
                                      header_values, max_size=1),
       path=st.sampled_from(PATHS))
def test_fuzzed_slo_extension_is_served_or_refused_never_500(served, slo, sent, path):
    assert_served_or_refused(post_served(served, path, small_request(path, False, slo=slo), sent))


@FUZZ
@given(fields=served_field_sets, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), stream=st.booleans())
def test_fuzzed_fields_of_served_requests_are_served_or_refused_never_500(served, fields, path, stream):
    assert_served_or_refused(post_served(served, path, small_request(path, stream, **fields)))


@pytest.mark.parametrize("header,value", [("x-slo-ttft-ms", "inf"), ("x-slo-ttft-ms", "1e400"),
                                          ("x-slo-tpot-ms", "inf"), ("x-slo-tpot-ms", "nan")])
def test_non_finite_slo_headers_are_400_and_the_gateway_keeps_serving(served, header, value):
    resp = post_served(served, "/v1/completions", small_request("/v1/completions", False), {header: value})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == header and err["type"] == "invalid_request_error", err
    assert header in err["message"] and "finite number of milliseconds" in err["message"], err
    ok = post_served(served, "/v1/completions", small_request("/v1/completions", False), {header: "60000"})
    assert ok.status_code == 200 and ok.json()["choices"], ok.text


@pytest.mark.parametrize("slo_text", ['{"ttft_ms": 1e400}', '{"tpot_ms": Infinity}', '{"ttft_ms": NaN}',
                                      '{"ttft_ms": -5}', '{"ttft_ms": "soon"}', '{"tier": ["interactive"]}',
                                      '{"ttft_ms": 1' + "0" * 5000 + '}', '"interactive"'])
def test_unusable_slo_extensions_are_400(served, slo_text):
    body = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "slo": {slo_text}}}'
    resp = post_served(served, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    assert_openai_error_shape(resp)


@pytest.mark.parametrize("prompt,bad", [([1, 2, VOCAB], VOCAB), ([-1], -1), ([[1, 2], [3, 100_000]], 100_000),
                                        ([[-3], [1]], -3), ([2**63], 2**63)])
def test_out_of_vocabulary_token_ids_are_400_naming_the_id(served, prompt, bad):
    resp = post_served(served, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 400, resp.text
    assert_openai_error_shape(resp)
    assert str(bad) in resp.json()["error"]["message"], resp.text


def test_the_last_token_id_of_the_vocabulary_is_served(served):
    resp = post_served(served, "/v1/completions", {"model": MODEL, "prompt": [[0, VOCAB - 1], [1]], "max_tokens": 2})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text


@pytest.mark.parametrize("top_k", [VOCAB + 1, 2**63, 2**70])
def test_a_top_k_past_the_vocabulary_is_served_as_no_top_k(served, top_k):
    # 2**70 does not encode for the workers (msgpack takes 64 bits): a 500, before the gateway said
    # what vLLM's engine says, that such a top_k is the whole vocabulary.
    resp = post_served(served, "/v1/completions", small_request("/v1/completions", False, top_k=top_k))
    assert resp.status_code == 200 and resp.json()["choices"], resp.text


@pytest.mark.parametrize("request_id", ["a\r\nx-injected: 1", "a\x00b", "\u0100", "caf\u00e9"])
def test_a_request_id_that_no_header_can_carry_is_400(served, request_id):
    # The fleet id goes back in x-skyline-request-id: with "\r\n" in it uvicorn dropped the
    # connection without any answer, and past Latin-1 the response failed to encode (a 500).
    resp = post_served(served, "/v1/completions", small_request("/v1/completions", False, request_id=request_id))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "request_id", resp.text
    ok = post_served(served, "/v1/completions", small_request("/v1/completions", False, request_id="my id/1"))
    assert ok.status_code == 200 and ok.headers["x-skyline-request-id"].startswith("cmpl-my id/1-"), ok.text


def test_deeply_nested_body_is_400(gateway):
    gw, _ = gateway
    for field in ("slo", "prompt", "stop"):
        body = f'{{"model": "{MODEL}", "prompt": "hi", "{field}": {"[" * 5000 + "]" * 5000}}}'
        resp = httpx.post(gw.url + "/v1/completions", content=body.encode(),
                          headers={"content-type": "application/json"}, timeout=10)
        assert resp.status_code == 400, resp.text
        assert "too deeply" in resp.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [("prompt", "hi \udcff"), ("bad_words", ["\ud800"]), ("stop", ["\udfff x"])])
def test_unpaired_surrogates_are_400(gateway, field, value):
    gw, _ = gateway
    body = json.dumps({"model": MODEL, "prompt": "hi", field: value})  # ensure_ascii writes them as \\udxxx escapes
    resp = httpx.post(gw.url + "/v1/completions", content=body.encode(), headers={"content-type": "application/json"},
                      timeout=10)
    assert resp.status_code == 400, resp.text
    assert "surrogate" in resp.json()["error"]["message"]


def test_a_surrogate_pair_is_text(gateway):
    gw, _ = gateway
    body = json.dumps({"model": MODEL, "prompt": "hi \U0001F600"})  # written as the pair \\ud83d\\ude00
    assert "\\ud83d" in body
    resp = httpx.post(gw.url + "/v1/completions", content=body.encode(), headers={"content-type": "application/json"},
                      timeout=10)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_workers", resp.text  # valid: reaches the fleet


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


# A chat template that crashes on every conversation: on "find" with a ValueError ("substring not
# found"), on anything else with a TypeError (str + int); except on "reject", which it refuses itself
# through `raise_exception`.
FAILING_TEMPLATE = ("{% set c = messages[0]['content'] %}{% if c == 'reject' %}{{ raise_exception('the first "
                    "message may not say reject') }}{% elif c == 'find' %}{{ c.index('zzz') }}{% endif %}{{ c + 17 }}")
CRASH_TEXT = {"hi": "can only concatenate", "find": "substring not found"}  # what no client may see


@pytest.fixture(scope="module")
def failing_template(redis_url):
    cfg = SkylineConfig(redis=RedisConfig(url=redis_url), gateway=GatewayConfig(chat_template=FAILING_TEMPLATE),
                        key_prefix=f"fuzz-{uuid.uuid4().hex[:8]}")
    with GatewayThread(cfg, None, MODEL, 256) as gw:
        yield gw


@pytest.mark.parametrize("path,stream,content", [("/v1/chat/completions", False, "hi"),
                                                 ("/v1/chat/completions", True, "hi"),
                                                 ("/v1/chat/completions", False, "find"),
                                                 ("/v1/responses", False, "hi"), ("/tokenize", False, "hi")])
def test_a_crashing_chat_template_is_an_internal_error_with_the_request_id(failing_template, caplog, path, stream,
                                                                           content):
    if path == "/v1/responses":
        body = {"model": MODEL, "input": content, "store": False}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        if path != "/tokenize":
            body.update(max_tokens=2, stream=stream)
    with caplog.at_level(logging.ERROR, logger="skyline.gateway"):
        resp = httpx.post(failing_template.url + path, json=body, timeout=10)
    assert resp.status_code == 500, resp.text
    assert_openai_error_shape(resp)
    err = resp.json()["error"]
    assert CRASH_TEXT[content] not in resp.text and "Error" not in err["message"], resp.text
    assert err["type"] == "server_error" and err["code"] == "internal_error", err
    request_id = resp.headers["x-skyline-request-id"]
    assert request_id in err["message"], err
    # The details are in the gateway's log, under the id the client got.
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info and CRASH_TEXT[content] in str(logged[0].exc_info[1].__cause__), caplog.text
    # Nothing stuck: the gateway still answers (and refuses the next one the same way).
    assert httpx.post(failing_template.url + path, json=body, timeout=10).status_code == 500


def test_a_chat_templates_own_refusal_reaches_the_client_as_vllm_answers_it(failing_template):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "reject"}], "max_tokens": 2}
    resp = httpx.post(failing_template.url + "/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == "the first message may not say reject", resp.text


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": [], "max_tokens": 2}),
                                       ("/v1/responses", {"input": [], "store": False})])
def test_an_empty_conversation_is_refused_as_vllm_refuses_it(failing_template, path, body):
    # transformers refuses it before any template runs: a ValueError vLLM answers 400 with its text.
    resp = httpx.post(failing_template.url + path, json={"model": MODEL, **body}, timeout=10)
    assert resp.status_code == 400, resp.text
    assert "empty conversation" in resp.json()["error"]["message"], resp.text


def test_a_template_vllms_messages_api_cannot_probe_leaves_that_api_refused_with_why(failing_template):
    # vLLM's Messages serving renders a probe conversation when it is built; this template crashes on it
    # (vllm serve would not start): the gateway serves its other routes and says why /v1/messages is not.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(failing_template.url + "/v1/messages", json=body, timeout=10)
    assert resp.status_code == 501 and "chat template" in resp.json()["error"]["message"], resp.text
    assert resp.json()["type"] == "error"  # the Messages API's error shape
