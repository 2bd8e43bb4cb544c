"""Start a real fleet (gateway + workers as processes, like `skyline up`) for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from skyline.core.net import free_port
from skyline.tools.bench.simfleet import wait_for_workers


class RestartableRedis:
    """A redis-server of its own (the session one must not be restarted under other tests), stopped
    and started again on the same port and data directory: with persistence "aof" it reloads its
    append-only file, with "none" it comes back empty."""

    def __init__(self, data_dir: Path, persistence: str):
        from skyline.tools.redis_server import start_redis

        self._start = start_redis
        self.port = free_port()
        self.data_dir = data_dir
        self.persistence = persistence
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = start_redis(self.port, data_dir, persistence)

    def stop(self) -> None:
        self.proc.terminate()  # SIGTERM: with AOF on, Redis flushes it before exiting
        self.proc.wait(timeout=10)

    def start(self) -> None:
        self.proc = self._start(self.port, self.data_dir, self.persistence)


class Fleet:
    """Gateway and workers as `python -m skyline.cli ...` processes against one Redis.

    Logs go to files under `log_dir` and are printed when start-up fails, so a
    broken fleet explains itself in the test output.
    """

    # The end-to-end tests exercise the disaggregated path with short prompts, which the
    # default config prefills on the decode worker (min_remote_prefill_tokens = 256):
    # their gateways send every prompt to the prefill pool unless a test says otherwise.
    EVERY_PROMPT_REMOTE = ("--min-remote-prefill-tokens", "0")

    def __init__(self, redis_url: str, key_prefix: str, engine: str, log_dir: Path, extra: list[str] | None = None,
                 gateway_args: tuple[str, ...] = EVERY_PROMPT_REMOTE):
        self.gateway_args = gateway_args
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.engine = engine
        self.log_dir = log_dir
        self.extra = extra or []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}

    def _common(self) -> list[str]:
        return ["--redis-url", self.redis_url, "--key-prefix", self.key_prefix, "--engine", self.engine, *self.extra]

    def wrap(self, name: str) -> list[str]:
        """Command prefix for process `name` (the multi-host test runs each in a network namespace)."""
        return []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [*self.wrap(name), sys.executable, "-m", "skyline.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def start_gateway(self, *args: str) -> None:
        self.start("gateway", ["gateway", *self._common(), "--port", str(self.port), *self.gateway_args, *args])

    def start_worker(self, name: str, role: str, *args: str) -> subprocess.Popen:
        return self.start(name, ["worker", role, *self._common(), "--worker-id", name, *args])

    @contextlib.contextmanager
    def running(self, workers: dict[str, tuple[str, ...]], timeout_s: float):
        """Gateway plus `workers` (name -> (role, *extra args)), ready; everything stopped on exit."""
        self.start_gateway()
        for name, (role, *args) in workers.items():
            self.start_worker(name, role, *args)
        try:
            want: dict[str, int] = {}
            for role, *_ in workers.values():
                want[role] = want.get(role, 0) + 1
            self.wait_ready(want, timeout_s)
            yield self
        finally:
            self.stop_all()

    def client(self, timeout_s: float):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
            return json.loads(resp.read())

    def worker_metrics(self, worker_id: str) -> str:
        """A worker's /metrics text (its port, from its heartbeat)."""
        import redis

        port = redis.Redis.from_url(self.redis_url).hget(f"{self.key_prefix}:worker:{worker_id}", "metrics_port")
        with urllib.request.urlopen(f"http://127.0.0.1:{int(port)}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def wait_ready(self, want: dict[str, int], timeout_s: float) -> None:
        def alive() -> None:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.logs(name)}")

        if not wait_for_workers(self.url, want, timeout_s, alive):
            raise TimeoutError(f"fleet not ready in {timeout_s}s:\n" + "\n".join(self.logs(n) for n in self.procs))

    def logs(self, name: str, tail: int = 4000) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return f"--- {name} ---\n{text[-tail:]}"

    def all_logs(self, tail: int = 3000) -> str:
        """The end of every process log, killed processes included (shown when a test fails)."""
        return "\n".join(self.logs(p.stem, tail) for p in sorted(self.log_dir.glob("*.log")))

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        p = self.procs.pop(name)
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return p.returncode

    def stop_all(self) -> None:
        for name in [n for n in self.procs if n != "gateway"] + (["gateway"] if "gateway" in self.procs else []):
            self.stop(name)
