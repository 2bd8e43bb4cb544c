"""Processes that end with their parent (Linux: PR_SET_PDEATHSIG).

A fleet's processes must not outlive what started them: a vLLM engine-core process left behind
by a worker killed with SIGKILL kept running with parent 1 for over 20 minutes, ignoring SIGTERM,
and on a GPU host it would hold the device memory a replacement worker needs. The kernel can
send a process a signal when its parent dies; the parent cannot, being dead.

Two ways in: `skyline up` starts each child with `preexec_fn=parent_death_signal(SIGTERM)` (a
worker then drains as on any SIGTERM), and a worker marks the vLLM engine processes it spawns
through the environment (ENGINE_OWNER_PID), where SIGKILL is armed in each of them (they hold no
state worth a drain) as early as Python lets us: `skyline/__init__.py`, which a spawned process
imports while it re-creates its parent's main module, before it imports vLLM. Armed later (Skyline's
vLLM plugin loads only after the engine core's handshake with its parent), a worker killed while
its engine started left an engine core waiting for ever on a handshake nobody would answer, with
vLLM's start-up handler ignoring SIGTERM. The plugin arms it again for processes whose main module
is not Skyline's (an engine started in-process by a test).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

from skyline.core import envs

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals, parent_pid: int | None = None) -> bool:
    """Ask the kernel for `sig` when this process's parent dies; if it is already gone (the
    parent is not `parent_pid`, or we were handed to init), send it now. False where the
    platform has no such thing (then nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    ppid = os.getppid()
    if ppid == 1 or (parent_pid is not None and ppid != parent_pid):  # it died before we asked
        os.kill(os.getpid(), sig)
    return True


def parent_death_signal(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when the caller dies. Call it in the
    thread that will wait for the child (the signal follows the thread that forked)."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent) and None


def mark_engine_processes() -> None:
    """In a worker, before it spawns its vLLM engine: the processes spawned from here on end with
    their parent (Skyline's vLLM plugin reads the mark in each of them)."""
    os.environ[envs.ENGINE_OWNER_PID.name] = str(os.getpid())


def engine_process_ends_with_parent() -> None:
    """In a vLLM process (the plugin's entry point): if a Skyline worker spawned it, directly or
    through vLLM's engine-core process, SIGKILL when its parent dies. Nothing in the worker itself,
    nor in vLLM processes Skyline did not start."""
    owner = envs.ENGINE_OWNER_PID.get()
    if owner and owner != str(os.getpid()):
        die_with_parent(signal.SIGKILL)
        if not _alive(int(owner)):  # the worker died before this process could ask (its parent may be the
            os.kill(os.getpid(), signal.SIGKILL)  # engine core, itself still alive, or a subreaper)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
