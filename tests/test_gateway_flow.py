"""The gateway's request flow with the test playing the worker by hand (redis-py, real Redis):
what it enqueues, how it relays frames in both OpenAI shapes, and how it cancels."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest
import redis

from skyline.core import messages
from skyline.core.config import GatewayConfig, RedisConfig, SkylineConfig
from skyline.core.keys import Keys
from skyline.gateway.testing import GatewayThread, announce_workers
from skyline.tools.bench.tokenizer import SimTokenizer

MODEL = "sim-model"
MAX_MODEL_LEN = 512


class HandWorker:
    """Plays a prefill/decode worker: claims what the gateway enqueued and publishes frames."""

    def __init__(self, redis_url: str, keys: Keys):
        self.r = redis.Redis.from_url(redis_url)
        self.keys = keys

    def take(self, stage: str, tier: str = "standard", timeout_s: float = 5.0):
        resp = self.r.xreadgroup(Keys.group(stage), "hand-worker", {self.keys.stream(stage, tier): ">"},
                                 count=1, block=int(timeout_s * 1000))
        assert resp, f"nothing enqueued on {stage}/{tier}"
        [(_key, [(_entry_id, fields)])] = resp
        return {k.decode(): v for k, v in fields.items()}, messages.decode(fields[b"msg"])

    def send(self, *frames: messages.Message, gap_s: float = 0.0) -> None:
        for f in frames:
            assert self.r.publish(self.keys.tokens(f.request_id), messages.encode(f)) == 1, "gateway not listening"
            if gap_s:
                time.sleep(gap_s)

    def script(self, rid: str, texts: list[str], finish: str = "stop", prompt_tokens: int = 0) -> list:
        frames, index = [], 0
        for seq, text in enumerate(texts):
            frames.append(messages.TokenDelta(rid, seq, index, [ord(c) for c in text], text))
            index += len(text)
        frames.append(messages.Finished(rid, len(texts), finish, prompt_tokens, index,
                                        timings={"prefill_ms": 1.5, "decode_ms": 4.0},
                                        kv_transfer={"bytes": 4096, "ms": 0.7},
                                        decode_worker="decode-hand-1", prefill_worker="prefill-hand-0"))
        return frames


def make_cfg(redis_url: str, key_prefix: str, **gateway: object) -> SkylineConfig:
    gw = replace(GatewayConfig(), worker_liveness_s=600, **{"min_remote_prefill_tokens": 0, **gateway})
    return SkylineConfig(redis=RedisConfig(url=redis_url), gateway=gw, key_prefix=key_prefix)


@pytest.fixture
def fleet(redis_url, key_prefix):
    """A gateway plus a hand-played worker of each role."""
    cfg = make_cfg(redis_url, key_prefix)
    announce_workers(redis_url, Keys(key_prefix), "prefill", "decode", model=MODEL)
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        with ThreadPoolExecutor(2) as pool:
            yield gw, client, HandWorker(redis_url, Keys(key_prefix)), pool


def test_completion_non_stream(fleet):
    _gw, client, worker, pool = fleet
    t0 = time.time() * 1000
    fut = pool.submit(client.completions.with_raw_response.create, model=MODEL, prompt="Hello there",
                      max_tokens=5, temperature=0, seed=7, stop="\n")
    fields, msg = worker.take("prefill")
    assert isinstance(msg, messages.GenerateRequest)
    assert msg.request_id.startswith("cmpl-") and fields["id"] == msg.request_id.encode()
    assert fields["tier"] == b"standard" and msg.tier == "standard" and msg.priority == 1
    assert msg.prompt_token_ids == list(b"Hello there") and msg.route == "disagg" and msg.model == MODEL
    assert abs(msg.arrival_ms - t0) < 2000 and msg.deadline_ms == msg.arrival_ms + 5000
    assert (msg.ttft_ms, msg.tpot_ms) == (5000, 500)
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.stop, s.top_p, s.stop_token_ids) == (5, 0.0, 7, ["\n"], 1.0, [])
    worker.send(*worker.script(msg.request_id, ["Hi", " you", "!"], prompt_tokens=11))
    raw = fut.result()
    assert raw.headers["x-skyline-request-id"] == msg.request_id and raw.headers["x-skyline-tier"] == "standard"
    body = raw.http_response.json()
    assert body["object"] == "text_completion" and body["id"] == msg.request_id and body["model"] == MODEL
    assert body["choices"][0]["text"] == "Hi you!" and body["choices"][0]["finish_reason"] == "stop"
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    sky = body["skyline"]
    assert sky["tier"] == "standard" and sky["route"] == "disagg" and sky["slo_met"] is True
    assert sky["ttft_ms"] > 0 and sky["tpot_ms"] >= 0
    assert sky["prefill_worker"] == "prefill-hand-0" and sky["decode_worker"] == "decode-hand-1"
    assert sky["kv_transfer"] == {"bytes": 4096, "ms": 0.7} and sky["timings"]["prefill_ms"] == 1.5
    assert raw.parse().choices[0].text == "Hi you!"  # and the openai client is happy with the shape


def test_chat_stream_colocated_with_usage(fleet):
    _gw, client, worker, pool = fleet
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]

    def run():
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, stream=True, stream_options={"include_usage": True},
            extra_headers={"x-skyline-route": "colocated", "x-slo-tier": "interactive"})
        return list(stream)

    fut = pool.submit(run)
    fields, work = worker.take("decode", "interactive")
    assert isinstance(work, messages.DecodeWork) and work.kv_handle is None
    msg = work.request
    assert msg.request_id.startswith("chatcmpl-") and msg.route == "colocated" and msg.priority == 0
    expected = SimTokenizer().apply_chat_template([{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hello"}])
    assert msg.prompt_token_ids == expected and fields["prompt_tokens"] == str(len(expected)).encode()
    # vLLM's defaults: the rest of the context, temperature 1
    assert msg.sampling.max_tokens == MAX_MODEL_LEN - len(expected) and msg.sampling.temperature == 1.0
    worker.send(*worker.script(msg.request_id, ["The", " answer", "."], finish="length"), gap_s=0.02)
    chunks = fut.result()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer."
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 11
    assert last.usage.prompt_tokens == len(expected)  # the worker sent 0: the gateway knows the prompt
    sky = last.model_extra["skyline"]
    assert sky["tier"] == "interactive" and sky["route"] == "colocated" and sky["slo_met"] is True
    assert sky["tpot_ms"] is not None and sky["slo_target"] == {"ttft_ms": 1000, "tpot_ms": 250}
    assert {c.id for c in chunks} == {msg.request_id}


def test_raw_sse_shape_and_done(fleet):
    gw, _client, worker, pool = fleet

    def run():
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={"model": MODEL, "prompt": "abc", "max_tokens": 8, "stream": True}) as resp:
            return resp.status_code, dict(resp.headers), resp.read().decode()

    fut = pool.submit(run)
    _fields, msg = worker.take("prefill")
    frames = worker.script(msg.request_id, ["x", "y", "z"])
    worker.send(frames[0])
    time.sleep(0.05)
    worker.send(*frames[1:])  # the last delta and Finished may arrive together
    status, headers, text = fut.result()
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-skyline-request-id"] == msg.request_id
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(c["object"] == "text_completion" and c["id"] == msg.request_id for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "xyz"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "skyline" in chunks[-1] and "usage" not in chunks[-1]  # no include_usage: no usage chunk


def test_duplicate_frames_are_not_repeated(fleet):
    _gw, client, worker, pool = fleet
    fut = pool.submit(client.completions.create, model=MODEL, prompt="dup", max_tokens=4)
    _f, msg = worker.take("prefill")
    a, b, fin = worker.script(msg.request_id, ["A", "B"])
    worker.send(a, a, b, a, b, fin)
    assert fut.result().choices[0].text == "AB"


def test_cache_salt_travels_with_the_prompt(fleet):
    _gw, client, worker, pool = fleet
    fut = pool.submit(client.completions.create, model=MODEL, prompt="salted", max_tokens=2,
                      extra_body={"cache_salt": "tenant-a"})
    _f, msg = worker.take("prefill")
    assert msg.cache_salt == "tenant-a"
    worker.send(*worker.script(msg.request_id, ["o", "k"]))
    assert fut.result().choices[0].text == "ok"


def test_failed_frame_becomes_http_error(fleet):
    _gw, client, worker, pool = fleet
    fut = pool.submit(client.completions.create, model=MODEL, prompt="boom", max_tokens=4)
    _f, msg = worker.take("prefill")
    worker.send(messages.Failed(msg.request_id, 1 << 30, 500, "engine exploded", "server_error", "engine_error"))
    with pytest.raises(openai.InternalServerError) as ei:
        fut.result()
    assert ei.value.status_code == 500 and ei.value.response.json()["error"]["message"] == "engine exploded"
    # A stream that fails before its first token also gets a real HTTP status.
    fut = pool.submit(lambda: list(client.completions.create(model=MODEL, prompt="x", stream=True)))
    _f, msg = worker.take("prefill")
    worker.send(messages.Failed(msg.request_id, 0, 429, "shed: SLO cannot be met", "rate_limit_error"))
    with pytest.raises(openai.RateLimitError):
        fut.result()


def test_a_responses_stream_relays_vllms_events_and_its_failures(fleet):
    """/v1/responses, streamed: vLLM's events as `vllm serve` writes them. A request the fleet refuses
    before its first token gets the HTTP status (vLLM sends its opening events before it starts the
    request: they wait in the gateway); a failure after it ends the stream with an `error` event."""
    _gw, client, worker, pool = fleet
    kw = dict(model=MODEL, input="q", store=False, stream=True)

    def run() -> list:
        return list(client.responses.create(**kw))

    fut = pool.submit(run)
    _f, msg = worker.take("prefill")
    worker.send(*worker.script(msg.request_id, ["Par", "is"]))
    events = fut.result()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris"
    assert events[-1].response.output_text == "Paris"

    fut = pool.submit(run)
    _f, msg = worker.take("prefill")
    worker.send(messages.Failed(msg.request_id, 0, 429, "shed: SLO cannot be met", "rate_limit_error"))
    with pytest.raises(openai.RateLimitError):
        fut.result()
    # Refused by the gateway itself (vLLM's own error type, raised on its way to the fleet): a 400 too.
    with pytest.raises(openai.BadRequestError, match="session_id"):
        client.responses.create(**kw, extra_headers={"x-session-id": "s"})

    fut = pool.submit(run)
    _f, msg = worker.take("prefill")
    worker.send(messages.TokenDelta(msg.request_id, 0, 0, [1], "Par"),
                messages.Failed(msg.request_id, 1, 500, "engine exploded", "server_error", "engine_error"))
    events = fut.result()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Par"
    assert events[-1].type == "error" and events[-1].message == "engine exploded"


def test_a_request_redis_refuses_to_enqueue_is_counted_once(fleet, monkeypatch):
    """XADD fails (Redis went away between admission and the enqueue): a 503, counted once in
    skyline_gateway_requests_total (the session that closed counts it; the refusal is not counted
    again on its way out)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    import skyline.gateway.dispatch as dispatch

    gw, client, _worker, _pool = fleet

    async def refused(*_a, **_k):
        raise RedisConnectionError("connection reset")

    monkeypatch.setattr(dispatch, "enqueue", refused)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 503

    def counted() -> float:
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("skyline_gateway_requests_total") and 'status="503"' in line)

    deadline = time.monotonic() + 2  # the session records its status just after the response
    while counted() < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    assert counted() == 1


def _chat_failing_mid_stream(fleet, send_frames) -> None:
    """A streamed chat whose worker sends "par" then fails: the text arrives, then the error."""
    _gw, client, worker, pool = fleet
    got: list[str] = []

    def run():
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                                    stream=True):
            got.append(chunk.choices[0].delta.content or "")

    fut = pool.submit(run)
    _f, msg = worker.take("prefill")
    send_frames(worker, messages.TokenDelta(msg.request_id, 0, 0, [1], "par"),
                messages.Failed(msg.request_id, 1, 502, "decode worker died", "server_error"))
    with pytest.raises(openai.APIError) as ei:
        fut.result()
    assert "decode worker died" in str(ei.value) and "".join(got) == "par"


def test_failure_mid_stream_is_an_sse_error(fleet):
    _chat_failing_mid_stream(fleet, lambda worker, *frames: worker.send(*frames))


def test_tokens_before_a_failure_in_one_batch_still_reach_the_stream(fleet):
    # Both frames in one MULTI/EXEC: the gateway reads them in one batch. The text that came
    # before the failure is sent, then the error (a 200 stream ending in an error event).
    def in_one_batch(worker, *frames):
        with worker.r.pipeline(transaction=True) as pipe:
            for f in frames:
                pipe.publish(worker.keys.tokens(f.request_id), messages.encode(f))
            pipe.execute()

    _chat_failing_mid_stream(fleet, in_one_batch)


def _wait_cancel(pubsub, timeout_s: float = 5.0) -> messages.Cancel:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = pubsub.get_message(timeout=0.1)
        if m and m["type"] == "message":
            return messages.decode(m["data"])
    raise AssertionError("no Cancel published")


@pytest.fixture
def cancels(redis_url, key_prefix):
    ps = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    ps.subscribe(Keys(key_prefix).cancel)
    yield ps
    ps.close()


def test_stream_disconnect_cancels(fleet, cancels):
    gw, _client, worker, pool = fleet

    def run():
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "long story"}], "stream": True}) as resp:
            for line in resp.iter_lines():
                if '"content":"once"' in line:
                    return  # leave mid-stream: closes the connection

    fut = pool.submit(run)
    _f, msg = worker.take("prefill")
    worker.send(messages.TokenDelta(msg.request_id, 0, 0, [1], "once"))
    fut.result()
    cancel = _wait_cancel(cancels)
    assert cancel.request_id == msg.request_id and cancel.reason == "client_disconnected"
    ttl = worker.r.ttl(worker.keys.cancelled(msg.request_id))
    assert 0 < ttl <= 600


def test_non_stream_disconnect_cancels(fleet, cancels):
    gw, _client, worker, pool = fleet
    fut = pool.submit(httpx.post, gw.url + "/v1/completions", json={"model": MODEL, "prompt": "p"}, timeout=0.5)
    _f, msg = worker.take("prefill")  # ... and never answer
    with pytest.raises(httpx.ReadTimeout):
        fut.result()
    cancel = _wait_cancel(cancels)
    assert cancel.request_id == msg.request_id
    assert worker.r.get(worker.keys.cancelled(msg.request_id)) == b"1"


def test_timeouts(redis_url, key_prefix, cancels):
    cfg = make_cfg(redis_url, key_prefix, first_frame_timeout_s=0.4, request_timeout_s=1.0)
    keys = Keys(key_prefix)
    announce_workers(redis_url, keys, "prefill", "decode", model=MODEL)
    worker = HandWorker(redis_url, keys)
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw, ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as ei:
            client.completions.create(model=MODEL, prompt="silence")
        assert ei.value.status_code == 503 and time.monotonic() - t0 < 2
        _f, msg = worker.take("prefill")
        assert _wait_cancel(cancels).request_id == msg.request_id
        # Output that starts but never finishes: 504 at request_timeout_s.
        fut = pool.submit(client.completions.create, model=MODEL, prompt="slow")
        _f, msg = worker.take("prefill")
        worker.send(messages.TokenDelta(msg.request_id, 0, 0, [1], "a"))
        with pytest.raises(openai.APIStatusError) as ei:
            fut.result()
        assert ei.value.status_code == 504
        assert _wait_cancel(cancels).request_id == msg.request_id


def test_slo_from_body_and_headers(fleet):
    _gw, client, worker, pool = fleet
    # A TTFT tighter than the default tier's moves the request to the interactive stream.
    fut = pool.submit(client.completions.create, model=MODEL, prompt="q", extra_body={"slo": {"ttft_ms": 800}})
    _f, msg = worker.take("prefill", "interactive")
    assert (msg.tier, msg.ttft_ms, msg.deadline_ms - msg.arrival_ms) == ("interactive", 800, 800)
    worker.send(*worker.script(msg.request_id, ["ok"]))
    assert fut.result().model_extra["skyline"]["tier"] == "interactive"
    # Headers win over the body.
    fut = pool.submit(client.completions.create, model=MODEL, prompt="q",
                      extra_body={"slo": {"tier": "batch", "tpot_ms": 100}},
                      extra_headers={"x-slo-tier": "standard", "x-slo-tpot-ms": "50"})
    _f, msg = worker.take("prefill", "standard")
    assert (msg.tier, msg.tpot_ms, msg.ttft_ms) == ("standard", 50, 5000)
    worker.send(*worker.script(msg.request_id, ["ok"]))
    fut.result()


def test_short_prompts_prefilled_on_decode_worker(redis_url, key_prefix):
    cfg = make_cfg(redis_url, key_prefix, min_remote_prefill_tokens=16)
    keys = Keys(key_prefix)
    announce_workers(redis_url, keys, "decode", model=MODEL)  # a short prompt needs no prefill worker
    worker = HandWorker(redis_url, keys)
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw, ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        fut = pool.submit(client.completions.create, model=MODEL, prompt="short")
        _f, work = worker.take("decode")
        assert work.request.route == "colocated"
        worker.send(*worker.script(work.request.request_id, ["k"]))
        assert fut.result().choices[0].text == "k"
        metrics = httpx.get(gw.url + "/metrics").text
        assert f'skyline_gateway_requests_total{{model="{MODEL}",route="colocated",status="200",tier="standard"}} 1.0' \
            in metrics
        assert f'skyline_gateway_ttft_seconds_count{{model="{MODEL}",tier="standard"}} 1.0' in metrics


def test_reasoning_parser_splits_reasoning_from_content(redis_url, key_prefix):
    """`--reasoning-parser` as vllm serve takes it: vLLM's parser runs in the gateway, on the fleet's frames."""
    cfg = make_cfg(redis_url, key_prefix, reasoning_parser="deepseek_r1")
    announce_workers(redis_url, Keys(key_prefix), "prefill", "decode", model=MODEL)
    worker = HandWorker(redis_url, Keys(key_prefix))
    think, end = 257, 258  # skyline/core/sim_model.py
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw, ThreadPoolExecutor(2) as pool:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        for stream in (False, True):
            def run(stream=stream):
                kw = dict(model=MODEL, messages=[{"role": "user", "content": "why?"}], max_tokens=32)
                if not stream:
                    m = client.chat.completions.create(**kw).choices[0].message
                    return m.model_extra.get("reasoning"), m.content
                reasoning, content = "", ""
                for c in client.chat.completions.create(**kw, stream=True):
                    if c.choices:
                        reasoning += c.choices[0].delta.model_extra.get("reasoning") or ""
                        content += c.choices[0].delta.content or ""
                return reasoning, content

            fut = pool.submit(run)
            _f, msg = worker.take("prefill")
            rid = msg.request_id
            deltas = [([think], "<think>"), ([ord(c) for c in "hmm"], "hmm"), ([end], "</think>"),
                      ([ord(c) for c in "yes"], "yes")]
            frames = [messages.TokenDelta(rid, i, i, ids, text) for i, (ids, text) in enumerate(deltas)]
            worker.send(*frames, messages.Finished(rid, len(frames), "stop", 0, 6), gap_s=0.01)
            reasoning, content = fut.result()
            assert (reasoning, content.strip()) == ("hmm", "yes"), stream
        # The workers' engines do not know the reasoning parser: a grammar would constrain the reasoning too.
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json?"}],
                                           max_tokens=8, response_format={"type": "json_object"})
        assert "reasoning parser" in ei.value.message


def test_vllm_serves_serving_layer_flags_reach_vllms_serving_objects(redis_url, key_prefix):
    """`skyline gateway --enable-force-include-usage --response-role bot` (vllm serve's flags, parsed by vLLM's
    parser): a stream that did not ask for usage ends with it, and chat deltas carry that role, as vllm serve
    answers with those flags. Without them (the `fleet` fixture's tests) neither happens."""
    cfg = make_cfg(redis_url, key_prefix, vllm_args=("--enable-force-include-usage", "--response-role", "bot"))
    announce_workers(redis_url, Keys(key_prefix), "prefill", "decode", model=MODEL)
    worker = HandWorker(redis_url, Keys(key_prefix))
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw, ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        fut = pool.submit(lambda: list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)))
        _f, msg = worker.take("prefill")
        worker.send(*worker.script(msg.request_id, ["Yo", "!"]))
        chunks = fut.result()
    assert chunks[0].choices[0].delta.role == "bot"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_requests_are_checked_against_the_engines_vllm_arguments(redis_url, key_prefix):
    """The gateway checks a request as its fleet's engines would: with `--max-logprobs 30` among the engine
    arguments (`skyline up` passes every engine's to the gateway), 25 logprobs are taken where vLLM's
    default of 20 refuses them, as vllm serve with that flag does; 31 are refused naming the bound."""
    from skyline.core.engine_args import VllmArgs

    cfg = make_cfg(redis_url, key_prefix)
    cfg = replace(cfg, engine=replace(cfg.engine, vllm=VllmArgs(argv=("--max-logprobs", "30"))))
    announce_workers(redis_url, Keys(key_prefix), "prefill", "decode", model=MODEL)
    worker = HandWorker(redis_url, Keys(key_prefix))
    with GatewayThread(cfg, None, MODEL, MAX_MODEL_LEN) as gw, ThreadPoolExecutor(1) as pool:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
        fut = pool.submit(client.completions.create, model=MODEL, prompt="Hi", max_tokens=2, logprobs=25)
        _f, msg = worker.take("prefill")
        assert msg.sampling.params["logprobs"] == 25
        worker.send(messages.Failed(msg.request_id, 0, 503, "enough", "server_error"))
        with pytest.raises(openai.APIStatusError):
            fut.result()
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=31)
        assert "max allowed: 30" in ei.value.message


def test_cors_and_request_id_headers_as_vllm_serve_adds_them(redis_url, key_prefix):
    """`--allowed-origins`, `--enable-request-id-headers`: vLLM's own CORS set-up and X-Request-Id middleware
    on the gateway, as vllm serve adds them (the client's id echoed, else a new one); without the flags the
    gateway answers a browser's preflight without allowing the origin, as vllm serve does."""
    args = ("--allowed-origins", '["https://app.example"]', "--enable-request-id-headers")
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with GatewayThread(make_cfg(redis_url, key_prefix, vllm_args=args), None, MODEL, MAX_MODEL_LEN) as gw:
        got = httpx.options(gw.url + "/v1/chat/completions", headers=preflight)
        assert got.headers["access-control-allow-origin"] == "https://app.example"
        assert httpx.get(gw.url + "/v1/models", headers={"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"
        assert len(httpx.get(gw.url + "/v1/models").headers["x-request-id"]) == 32  # uuid4 hex
    with GatewayThread(make_cfg(redis_url, key_prefix), None, MODEL, MAX_MODEL_LEN) as gw:
        got = httpx.options(gw.url + "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in got.headers
        assert "x-request-id" not in httpx.get(gw.url + "/v1/models").headers
