"""A Redis restart fails no stream that could continue (docs/reliability.md "Redis persistence").

A sim fleet on the disaggregated route (gateway; a prefill worker taking one ~0.5 s prompt at a
time; a decode worker running two streams at a time) serves six streams; Redis is restarted
(SIGTERM, then started again on the same port and data directory) while two are mid-stream and
the others are being prefilled or wait on the prefill and decode streams. With AOF
every stream completes with exactly the text of the same request in a run without the
restart: nothing missing, nothing twice. Without persistence every one of them ends with
the explicit `redis_state_lost` error, none hangs, and the fleet serves again after.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from skyline.workers.outage import ride_out
from tests.fleet import Fleet, RestartableRedis

pytestmark = pytest.mark.faults

MODEL = "skyline-sim"
MAX_TOKENS = 30  # 1.5 s a stream at 0.05 s a token
PROMPTS = [f"resume stream number {i}" for i in range(6)]
CONFIG = """
[engine]
sim_prefill_per_token_s = 0.02
sim_decode_base_s = 0.05
sim_decode_per_seq_s = 0.0

[worker]
heartbeat_s = 0.25
max_running = 2
tpot_headroom = 0

[gateway]
admission = false
"""


class Streams:
    """The six streams, each in a thread, with what each has received so far."""

    def __init__(self, client: openai.OpenAI):
        self.client = client
        self.text = [""] * len(PROMPTS)
        self.errors: list[openai.APIError | None] = [None] * len(PROMPTS)
        self.pool = ThreadPoolExecutor(len(PROMPTS))
        self.futures = [self.pool.submit(self._one, i) for i in range(len(PROMPTS))]

    def _one(self, i: int) -> None:
        try:
            for chunk in self.client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True,
                                                        extra_headers={"x-slo-tier": "batch"}):
                if chunk.choices:
                    self.text[i] += chunk.choices[0].text
        except openai.APIError as exc:
            self.errors[i] = exc

    def wait_mid_flight(self, timeout_s: float = 20) -> tuple[list[int], list[int]]:
        """Once two streams have text but are not done: (streaming, still waiting) stream indexes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = [len(t) for t in self.text]
            streaming = [i for i, n in enumerate(snap) if 0 < n < MAX_TOKENS // 2]
            if len(streaming) >= 2:
                return streaming, [i for i, n in enumerate(snap) if n == 0]
            time.sleep(0.02)
        raise AssertionError(f"no two streams in flight: {self.text}")

    def join(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        for f in self.futures:
            f.result(timeout=max(0.1, timeout_s - (time.monotonic() - t0)))  # raises if one hangs
        self.pool.shutdown()


def run_fleet(srv: RestartableRedis, tmp_path):
    (tmp_path / "cfg.toml").write_text(CONFIG)
    fleet = Fleet(srv.url, "resume", "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    return fleet.running({"prefill-1": ("prefill", "--max-running", "1"), "decode-1": ("decode",)}, timeout_s=60)


def restart(srv: RestartableRedis, down_s: float = 3.0) -> None:
    """Down for longer than redis-py's own retries cover (~3 s with skyline's redisconn options,
    connects included), well within the grace (10 s) and the reaper's reclaim_after_s (5 s)."""
    srv.stop()
    time.sleep(down_s)
    srv.start()


@pytest.fixture
def aof_redis(tmp_path):
    srv = RestartableRedis(tmp_path / "redis", "aof")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture
def plain_redis(tmp_path):
    srv = RestartableRedis(tmp_path / "redis", "none")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_with_aof_streams_in_flight_complete_and_queued_work_is_served(aof_redis, tmp_path):
    with run_fleet(aof_redis, tmp_path) as fleet:
        client = fleet.client(timeout_s=30)
        reference = Streams(client)  # the same requests, no restart: the sim's text is the prompt's
        reference.join(30)
        assert not any(reference.errors) and all(len(t) == MAX_TOKENS for t in reference.text), reference.errors

        streams = Streams(client)
        _streaming, waiting = streams.wait_mid_flight()
        assert len(waiting) >= 2, streams.text  # queued (prefill or decode stream) or being prefilled
        restart(aof_redis)
        streams.join(40)
        assert streams.errors == [None] * len(PROMPTS), [str(e) for e in streams.errors]
        assert streams.text == reference.text  # every stream: nothing missing, nothing twice
        # Caught up by the relay from the frame logs, each stream still on its first decode attempt.
        assert "token relay: resumed" in fleet.logs("gateway", tail=100_000)
        assert "took over" not in fleet.logs("decode-1", tail=100_000)


def test_without_persistence_lost_requests_fail_explicitly_and_new_ones_are_served(plain_redis, tmp_path):
    with run_fleet(plain_redis, tmp_path) as fleet:
        client = fleet.client(timeout_s=30)
        streams = Streams(client)
        streaming, waiting = streams.wait_mid_flight()
        restart(plain_redis)
        t0 = time.monotonic()
        streams.join(20)  # nothing hangs
        assert time.monotonic() - t0 < 15
        assert all(streams.errors), streams.text
        assert all("Redis lost" in str(e) for e in streams.errors), [str(e) for e in streams.errors]
        # Not started: an HTTP error naming the cause; mid-stream: the text so far, then an error
        # chunk (vLLM's stream error format carries the message, not Skyline's code).
        assert all(getattr(streams.errors[i], "code", None) == "redis_state_lost" for i in waiting), waiting
        assert all(streams.text[i] for i in streaming)
        deadline = time.monotonic() + 30
        while True:  # workers and relay reconnect, groups are recreated: new requests are served
            try:
                resp = client.completions.create(model=MODEL, prompt="after", max_tokens=5, temperature=0)
                break
            except openai.APIError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert len(resp.choices[0].text) == 5


# ---- the workers' retry (workers/outage.py), without a fleet ------------------------------


async def test_a_call_is_retried_while_redis_is_unreachable_then_given_up():
    calls = []

    async def comes_back_on_the_third_try():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError("Connection refused")
        return "ok"

    assert await ride_out(comes_back_on_the_third_try, 5.0, "test") == "ok"
    assert len(calls) == 3 and calls[2] - calls[0] < 1.0  # short pauses first

    async def never():
        raise ConnectionError("Connection refused")

    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        await ride_out(never, 0.3, "test")
    assert 0.3 <= time.monotonic() - t0 < 1.0  # bounded by the grace

    async def not_an_outage():
        calls.append(0)
        raise ValueError("a bug, not Redis")

    with pytest.raises(ValueError):
        await ride_out(not_an_outage, 5.0, "test")
    assert calls[-2:] != [0, 0]  # raised at once, not retried
