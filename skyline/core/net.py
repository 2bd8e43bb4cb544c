"""Local network helpers shared by processes and tools."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
