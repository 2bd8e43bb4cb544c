"""A whole fleet as local processes (the `sim` engine by default), for benchmarks
that need to start, kill and restart its parts (Redis included).

Every process is started the way a user would (`python -m skyline.cli ...`),
against a Redis of its own on a free port; logs go to files in `workdir`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from skyline.tools.redis_server import start_redis

from skyline.core.net import free_port


def wait_for_workers(url: str, want: dict[str, int], timeout_s: float,
                     alive: Callable[[], None] = lambda: None) -> bool:
    """Whether the gateway at `url` reports at least `want` live workers of each role ({role: n}, its
    /health, which answers before they are up) within `timeout_s`. `alive` runs before each probe and raises
    when a process the caller started has died (a fleet that cannot come up says so at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        try:
            live = httpx.get(f"{url}/health", timeout=2).json().get("workers", {})
            if all(live.get(role, 0) >= n for role, n in want.items()):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    return False


class SimFleet:
    def __init__(self, workdir: Path, config_toml: str, persistence: str = "none", log_level: str = "WARNING",
                 engine: str = "sim", extra: tuple[str, ...] = ()):
        self.workdir = workdir
        self.persistence = persistence
        self.cfg_path = workdir / "fleet.toml"
        self.cfg_path.write_text(config_toml)
        self.redis_port = free_port()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis: subprocess.Popen | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.common = ["--redis-url", f"redis://127.0.0.1:{self.redis_port}/0", "--engine", engine,
                       "--config", str(self.cfg_path), "--log-level", log_level, *extra]

    # -- processes -------------------------------------------------------------------

    def start_redis(self) -> None:
        self.redis = start_redis(self.redis_port, self.workdir / "redis", self.persistence,
                                 log_file=self.workdir / "redis.log")

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.terminate()  # SIGTERM: with AOF on, Redis flushes it before exiting
            self.redis.wait(timeout=30)
            self.redis = None

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "skyline.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_gateway(self, *args: str) -> None:
        self._spawn("gateway", ["gateway", *self.common, "--port", str(self.port), *args])

    def start_worker(self, name: str, role: str, *args: str) -> None:
        self._spawn(name, ["worker", role, *self.common, "--worker-id", name, *args])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        proc.wait(timeout=60)

    def workers(self, role: str) -> list[str]:
        return [n for n in self.procs if n.startswith(f"{role}-")]

    def wait_ready(self, want: dict[str, int], timeout_s: float = 60.0) -> None:  # vLLM engines: pass ~600
        if not wait_for_workers(self.url, want, timeout_s):
            raise TimeoutError(f"sim fleet not ready in {timeout_s:g} s; logs in {self.workdir}")

    def start(self, n_prefill: int, n_decode: int, worker_args: tuple[str, ...] = ()) -> None:
        self.start_redis()
        self.start_gateway()
        for i in range(n_prefill):
            self.start_worker(f"prefill-{i}", "prefill", *worker_args)
        for i in range(n_decode):
            self.start_worker(f"decode-{i}", "decode", *worker_args)
        self.wait_ready({"prefill": min(n_prefill, 1), "decode": min(n_decode, 1)})

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "gateway"] + (["gateway"] if "gateway" in self.procs else []):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.stop_redis()
