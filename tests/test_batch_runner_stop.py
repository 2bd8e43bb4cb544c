"""The batch runner ends after SIGTERM even when Redis stops answering in the middle of its shutdown."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import redis

from skyline.batch.worker import STOP_GRACE_S
from skyline.core.net import free_port
from skyline.tools.redis_server import start_redis


def test_a_stopped_runner_ends_within_its_grace_when_redis_hangs(tmp_path):
    # A Redis stopped with SIGSTOP keeps its sockets and answers nothing, the way a Redis busy dying
    # (or a host gone) does: RQ's teardown writes to it with no socket timeout and would wait for ever.
    port = free_port()
    server = start_redis(port, tmp_path / "redis")
    log = open(tmp_path / "runner.log", "wb")
    runner = subprocess.Popen(
        [sys.executable, "-m", "skyline.cli", "batch-runner", "--redis-url", f"redis://127.0.0.1:{port}/0",
         "--gateway-url", "http://127.0.0.1:9", "--name", "stop-test"], stdout=log, stderr=subprocess.STDOUT)
    try:
        conn = redis.Redis(port=port)
        deadline = time.monotonic() + 60
        while not conn.exists("rq:worker:stop-test"):  # registered: idle in its queue wait
            assert runner.poll() is None and time.monotonic() < deadline, (tmp_path / "runner.log").read_text()
            time.sleep(0.2)
        time.sleep(0.5)
        server.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        runner.send_signal(signal.SIGTERM)
        rc = runner.wait(timeout=STOP_GRACE_S + 20)
        took = time.monotonic() - t0
        assert rc == 1 and STOP_GRACE_S - 1 <= took <= STOP_GRACE_S + 10, (rc, took)
        assert "still stopping" in (tmp_path / "runner.log").read_text()
    finally:
        runner.kill()
        server.send_signal(signal.SIGCONT)
        server.terminate()
        server.wait(timeout=10)
