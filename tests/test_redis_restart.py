"""Redis goes away and comes back: fast 503s while it is down, a working fleet after.

Redis stays away longer than the fleet's grace (`redis.outage_grace_s`) here, so the
stream in flight ends with an explicit error; tests/test_redis_resume.py restarts it
within the grace. Each test runs its own redis-server (the session one must not be
restarted under other tests), with and without persistence.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.fleet import Fleet, RestartableRedis

pytestmark = pytest.mark.faults

MODEL = "skyline-sim"
CONFIG = """
[redis]
outage_grace_s = 1.0

[engine]
sim_decode_base_s = 0.05
sim_decode_per_seq_s = 0.0

[worker]
heartbeat_s = 0.25
"""


@pytest.fixture(params=["none", "aof"])
def redis_srv(request, tmp_path):
    srv = RestartableRedis(tmp_path / "redis", request.param)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def ask(client: openai.OpenAI, max_tokens: int = 8) -> str:
    resp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=max_tokens, temperature=0)
    return resp.choices[0].text


def wait_until_serving(client: openai.OpenAI, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            ask(client)
            return time.monotonic() - t0
        except openai.APIError:
            if time.monotonic() - t0 > timeout_s:
                raise
            time.sleep(0.2)


def test_redis_restart(redis_srv, tmp_path):
    (tmp_path / "cfg.toml").write_text(CONFIG)
    fleet = Fleet(redis_srv.url, "restart", "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    with fleet.running({"prefill-1": ("prefill",), "decode-1": ("decode",)}, timeout_s=60):
        client = fleet.client(timeout_s=30)
        assert len(ask(client)) == 8

        # A stream in flight when Redis dies for longer than the grace ends with an explicit
        # error, not silence.
        errors: list[Exception] = []

        def long_stream() -> None:
            try:
                for _ in client.completions.create(model=MODEL, prompt="a long one", max_tokens=200, stream=True):
                    pass
            except openai.APIError as exc:
                errors.append(exc)

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(1.0)
        redis_srv.stop()
        t.join(timeout=10)
        assert not t.is_alive() and errors, "the in-flight stream neither failed nor finished"

        # Redis down: the gateway answers at once with 503.
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            ask(client)
        assert err.value.status_code == 503
        assert time.monotonic() - t0 < 3.0

        redis_srv.start()
        # Workers and the gateway reconnect with backoff, recreate groups, reload scripts.
        took = wait_until_serving(client, timeout_s=30)
        assert took < 30
        assert len(ask(client)) == 8
        health = fleet.health()
        assert health["workers"].get("prefill") == 1 and health["workers"].get("decode") == 1
