"""Process-tree helpers for tests that kill processes (read from /proc: Linux only)."""

from __future__ import annotations

import os
import time


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(int(entry))
        if st is not None:
            children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return [p for p in out if alive(p)]


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for a parent (init here may be slow to reap)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The processes of `pids` still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if alive(p)]
    return left
