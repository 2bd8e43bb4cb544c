"""End to end on the `sim` engine: the `openai` client -> gateway -> Redis -> workers, all real processes."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import openai
import pytest

from tests.fleet import Fleet
from tests.procs import wait_until

MODEL = "skyline-sim"


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    f = Fleet(redis_url, "e2e-sim", "sim", tmp_path_factory.mktemp("fleet-logs"))
    workers = {"prefill-a": ("prefill",), "decode-a": ("decode",), "decode-b": ("decode",)}
    with f.running(workers, timeout_s=60):
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout_s=30)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_stream(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.message.content) == 12  # sim: one byte per token
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 5
    ext = resp.model_extra["skyline"]
    assert ext["route"] == "disagg" and ext["prefill_worker"] == "prefill-a"
    assert ext["kv_transfer"]["remote_prefill"] is True


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "user", "content": "stream me"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 30


def test_completions_stream_and_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True
        ) if c.choices
    )
    assert streamed == full.choices[0].text and len(streamed) == 20
    assert full.object == "text_completion"


def test_colocated_route_gives_the_same_output(client):
    kw = dict(model=MODEL, prompt="route me", max_tokens=16, temperature=0)
    disagg = client.completions.create(**kw)
    coloc = client.completions.create(**kw, extra_headers={"x-skyline-route": "colocated"})
    assert coloc.choices[0].text == disagg.choices[0].text
    assert coloc.model_extra["skyline"]["route"] == "colocated"
    assert coloc.model_extra["skyline"]["kv_transfer"]["remote_prefill"] is False


def test_work_spreads_across_decode_workers(client):
    def one(i):
        r = client.completions.create(model=MODEL, prompt=f"spread {i}", max_tokens=40)
        return r.model_extra["skyline"]["decode_worker"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        workers = list(pool.map(one, range(32)))
    assert set(workers) == {"decode-a", "decode-b"}


def test_client_disconnect_aborts_the_request_on_the_worker(client, fleet, redis_url):
    import redis

    r = redis.Redis.from_url(redis_url)
    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=1500, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        running = [int(r.hget(f"e2e-sim:worker:{w}", "running") or 0) for w in ("decode-a", "decode-b")]
        if sum(running) == 0:
            break
        time.sleep(0.2)
    assert sum(running) == 0, "the decode worker kept generating for a client that left"


def test_status_cli_shows_streams_and_workers(fleet, redis_url):
    out = subprocess.run(
        [sys.executable, "-m", "skyline.cli", "status", "--redis-url", redis_url, "--key-prefix", "e2e-sim",
         "--once", "--json"], capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    snap = json.loads(out)
    keys = {s["key"] for s in snap["streams"]}
    assert "e2e-sim:{prefill}:interactive" in keys and "e2e-sim:{decode}:batch" in keys
    assert {w["worker_id"]: w["role"] for w in snap["workers"]} == {
        "prefill-a": "prefill", "decode-a": "decode", "decode-b": "decode"
    }
    assert all(s["pending"] == 0 for s in snap["streams"])


def test_no_decode_worker_alive_gives_503_quickly(fleet, client):
    # Runs last in this module: it takes the decode pool away.
    fleet.stop("decode-a")
    fleet.stop("decode-b")
    # A stopped worker deregisters itself; the gateway's view (its /health) refreshes every 0.5 s.
    wait_until(lambda: not fleet.health()["workers"].get("decode"), 10,
               lambda: f"the gateway to see no decode worker: {fleet.health()['workers']}")
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="anyone?", max_tokens=5)
    assert err.value.status_code == 503
    assert "decode" in err.value.message
    assert time.monotonic() - t0 < 2
