"""Waiting in tests: for a condition (`wait_until`, `await_until`), and for processes to go.

A test waits for the event it needs (a timeline event, a Redis key, a worker's held table, a
gateway's view), never for a fixed time that stands in for it. The process-tree helpers read
/proc: Linux only.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str | Callable[[], str],
               interval_s: float = 0.05) -> T:
    """Call `cond` every `interval_s` until it returns something true, and return that. Past
    `timeout_s`, an AssertionError says `what` (the event waited for; a callable: asked then, to
    show the state it found) did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(timeout_s, what, got))
        time.sleep(interval_s)


async def await_until(cond: Callable[[], T | Awaitable[T]], timeout_s: float, what: str | Callable[[], str],
                      interval_s: float = 0.05) -> T:
    """`wait_until` in an event loop: `cond` may be a plain function or a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(timeout_s, what, got))
        await asyncio.sleep(interval_s)


def _timed_out(timeout_s: float, what: str | Callable[[], str], got: object) -> str:
    return f"waited {timeout_s} s for {what() if callable(what) else what}: it did not happen (last check: {got!r})"


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
