"""A client that goes away is cancelled everywhere, in whichever phase its request is:
still queued, being prefilled, or being decoded. The worker that holds it aborts
the engine request (its KV freed), nothing reaches the next stage, and the
gateway counts the disconnect (HTTP 499 in `skyline_gateway_requests`)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import redis

from skyline.core.keys import Keys
from tests.fleet import Fleet

pytestmark = pytest.mark.faults

MODEL = "skyline-sim"
CONFIG = """
[engine]
sim_prefill_base_s = 0.005
sim_prefill_per_token_s = 0.004
sim_decode_base_s = 0.04
sim_decode_per_seq_s = 0.0

[worker]
heartbeat_s = 0.2
prefill_token_budget = 100
"""
LONG = "x" * 600  # ~2.4 s of prefill


@pytest.fixture
def fleet(redis_url, key_prefix, tmp_path):
    (tmp_path / "cfg.toml").write_text(CONFIG)
    f = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    with f.running({"prefill-1": ("prefill",), "decode-1": ("decode",)}, timeout_s=60):
        yield f


def running(r: redis.Redis, keys: Keys, worker: str) -> int:
    return int(r.hget(keys.worker(worker), "running") or 0)


def wait_for(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(what)
        time.sleep(0.02)
    return time.monotonic() - t0


def open_raw(url: str, prompt: str, max_tokens: int) -> socket.socket:
    """Send a streaming request on a raw socket: closing it is the client going away,
    at any moment (an HTTP client would first wait for the response headers, which
    the gateway sends with the first token)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def request_ids(r: redis.Redis, keys: Keys, stage: str) -> list[str]:
    return [f[b"id"].decode() for _, f in r.xrange(keys.stream(stage, "standard"))]


def disconnects(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("skyline_gateway_requests_total") and 'status="499"' in line)


def test_disconnect_in_each_phase_cancels_everywhere(fleet, redis_url, key_prefix):
    r, keys = redis.Redis.from_url(redis_url), Keys(key_prefix)

    # Prefilling: the prefill worker is running the long prompt when the client leaves.
    s1 = open_raw(fleet.url, LONG, 8)
    wait_for(lambda: running(r, keys, "prefill-1") == 1, 5, "prefill never started")
    # Queued: the budget (100 tokens) keeps a second long prompt in the stream meanwhile.
    s2 = open_raw(fleet.url, LONG + "y", 8)
    wait_for(lambda: len(request_ids(r, keys, "prefill")) == 2, 5, "second request not queued")
    rid1, rid2 = request_ids(r, keys, "prefill")
    s1.close()
    s2.close()
    took = wait_for(lambda: running(r, keys, "prefill-1") == 0, 3, "prefill not aborted")
    assert took < 1.5  # aborted within a chunk, not after the 2.4 s prefill
    for rid in (rid1, rid2):  # tombstones: a later claim skips the request
        wait_for(lambda: r.get(keys.cancelled(rid)) == b"1", 3, f"{rid} not cancelled")
    time.sleep(0.5)
    for rid in (rid1, rid2):
        assert r.hget(keys.run(rid), "handoff") is None  # never reached the decode stage
    assert not r.xpending_range(keys.stream("prefill", "standard"), "prefill", "-", "+", 10)

    # Decoding: the decode worker is streaming when the client leaves.
    s3 = open_raw(fleet.url, "short prompt", 500)
    s3.recv(100)  # the response has begun: the first token is out
    wait_for(lambda: running(r, keys, "decode-1") == 1, 2, "no decode")
    s3.close()
    wait_for(lambda: running(r, keys, "decode-1") == 0, 3, "decode not aborted")
    assert not r.xpending_range(keys.stream("decode", "standard"), "decode", "-", "+", 10)

    wait_for(lambda: disconnects(fleet.url) >= 3, 5, "disconnects not counted")
    assert disconnects(fleet.url) == 3
