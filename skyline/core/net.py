"""Local network helpers shared by processes and tools."""

from __future__ import annotations

import random
import socket

# Where a listen port is picked when the listener binds much later than the pick (a vLLM engine binds its
# NIXL side channel after loading the model): below the kernel's ephemeral range, which every outgoing
# connection on this machine draws its local port from (a Redis client, torch's Gloo, ...), so none of them
# can take the picked port in between. The floor stays clear of the well-known and registered low ports.
_LISTEN_FLOOR = 10000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (Linux; 32768, its default, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_ports(count: int = 1, *, span: int = 1, rng: random.Random | None = None) -> list[int]:
    """`count` base ports, each the first of `span` consecutive ports (an engine's ranks each listen on
    base + rank), free on 127.0.0.1 now, pairwise disjoint, and outside the ephemeral range (see
    `_LISTEN_FLOOR`). Drawn at random so that processes picking at the same time rarely collide."""
    rng = rng or random.SystemRandom()
    top = ephemeral_low() - span  # the last base whose span stays below the ephemeral range
    if top <= _LISTEN_FLOOR:
        raise OSError(f"no listen ports below the ephemeral range (it starts at {ephemeral_low()})")
    chosen: list[int] = []
    for _ in range(1000):
        base = rng.randint(_LISTEN_FLOOR, top)
        ports = range(base, base + span)
        if any(abs(base - c) < span for c in chosen) or any(port_taken("127.0.0.1", p) for p in ports):
            continue
        chosen.append(base)
        if len(chosen) == count:
            return chosen
    raise OSError(f"could not find {count} free runs of {span} ports below {ephemeral_low()}")


def listen_port(span: int = 1) -> int:
    """One base port as `listen_ports` picks them."""
    return listen_ports(1, span=span)[0]


def port_taken(host: str, port: int) -> bool:
    """Would a server fail to listen on host:port now (another process listens there)?"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_holder(port: int) -> str:
    """Who listens on TCP `port` on this machine, for an error message: "pid N (command line)"
    where the system tells (psutil, which vLLM brings), else "another process"."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                try:
                    cmd = " ".join(psutil.Process(conn.pid).cmdline())
                except psutil.Error:
                    cmd = "?"
                return f"pid {conn.pid} ({cmd[:120]})"
    except Exception:  # noqa: BLE001 - only the message is poorer: no psutil, or no permission to look
        pass
    return "another process"
