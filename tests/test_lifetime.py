"""Processes that end with their parent (skyline/core/lifetime.py), shown with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.procs import alive, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _parent(code: str, **env: str) -> tuple[subprocess.Popen, int]:
    """A Python process running `code`, which prints the pid of the child it started."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))
    return proc, int(proc.stdout.readline())


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


LAUNCHER = """
import signal, subprocess, time
from skyline.core.lifetime import parent_death_signal
child = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=parent_death_signal(signal.SIGTERM))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_started_with_the_parent_death_signal_ends_when_its_parent_is_killed():
    parent, child = _parent(LAUNCHER)
    assert alive(child)
    _kill(parent)
    assert not wait_gone([child], timeout_s=5)


# A worker as VllmEngine makes one: it marks the processes it spawns, then spawns one the way
# vLLM spawns its engine core (multiprocessing, spawn), which runs the plugin's entry point.
WORKER = """
import multiprocessing, sys, time

def engine_core():
    from skyline.workers.engines.engine_processes import register
    register()
    time.sleep(60)

if __name__ == "__main__":
    from skyline.core.lifetime import engine_process_ends_with_parent, mark_engine_processes
    if sys.argv[1] == "marked":
        mark_engine_processes()
    engine_process_ends_with_parent()  # in the worker itself: nothing (it must outlive its shell)
    ctx = multiprocessing.get_context("spawn")
    core = ctx.Process(target=engine_core)
    core.start()
    time.sleep(2)  # the child has loaded the plugin
    print(core.pid, flush=True)
    time.sleep(60)
"""


def _worker(tmp_path, marked: bool) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "worker.py"  # a file: spawn re-imports the main module in the child
    script.write_text(WORKER)
    proc = subprocess.Popen([sys.executable, str(script), "marked" if marked else "plain"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, int(proc.stdout.readline())


def test_the_engine_processes_a_worker_spawns_end_when_it_is_killed(tmp_path):
    worker, core = _worker(tmp_path, marked=True)
    assert alive(core)
    _kill(worker)  # its pid only, as `kill -9` does: the engine core is not signalled by anyone else
    assert not wait_gone([core], timeout_s=5), "the engine process outlived its worker"


def test_vllm_processes_skyline_did_not_start_are_left_alone(tmp_path):
    worker, core = _worker(tmp_path, marked=False)
    try:
        _kill(worker)
        assert wait_gone([core], timeout_s=2) == [core]  # no mark: the plugin changes nothing
    finally:
        os.kill(core, signal.SIGKILL)


# A worker killed while its engine starts: the engine core has not loaded the plugin yet (vLLM loads it
# after the handshake with its parent, which never comes), so only the mark read when the spawned
# process re-creates the worker's main module (it imports Skyline first, as `skyline.cli` does) ends it.
WORKER_KILLED_EARLY = """
import multiprocessing, sys, time
import skyline  # the worker's main module imports Skyline, as skyline.cli does

def engine_core_waiting_for_a_handshake():
    time.sleep(60)

if __name__ == "__main__":
    from skyline.core.lifetime import mark_engine_processes
    mark_engine_processes()
    core = multiprocessing.get_context("spawn").Process(target=engine_core_waiting_for_a_handshake)
    core.start()
    print(core.pid, flush=True)
    time.sleep(float(sys.argv[1]))
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("kill_after_s", [0.0, 1.5])
def test_an_engine_process_ends_with_a_worker_killed_before_the_plugin_loaded(tmp_path, kill_after_s):
    script = tmp_path / "worker.py"
    script.write_text(WORKER_KILLED_EARLY)
    worker = subprocess.Popen([sys.executable, str(script), str(kill_after_s)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    core = int(worker.stdout.readline())
    assert worker.stdout.readline().strip() == "ready"
    try:
        _kill(worker)  # at once (before the child imported anything), or once it waits for the handshake
        assert not wait_gone([core], timeout_s=5), "the engine process outlived its worker"
    finally:
        if alive(core):
            os.kill(core, signal.SIGKILL)


def _engine_processes_of(worker_pid: int) -> list[int]:
    """Processes marked as engine processes of `worker_pid` (vLLM's engine core and its executor)."""
    mark = f"SKYLINE_ENGINE_OWNER_PID={worker_pid}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") and int(pid) != worker_pid:
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.vllm
@pytest.mark.parametrize("kill_after_spawn_s", [0.5, 10.0])
def test_no_vllm_engine_outlives_a_worker_killed_while_it_starts(tmp_path, redis_url, key_prefix, kill_after_spawn_s):
    """A real worker on vLLM killed with SIGKILL at a moment of its engine's start-up, counted from
    the engine's first process (0.5 s: the engine core still imports; 10 s: it loads the model
    and spawns its executor; ~30 s in all here): within a few seconds no process of its engine
    remains. Counting from the spawn, not from the worker's start, keeps the moment the same on a
    loaded machine."""
    import time

    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "skyline.cli", "worker", "decode", "--engine", "vllm",
                               "--redis-url", redis_url, "--key-prefix", key_prefix, "--metrics-port", "0"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: set[int] = set()
    try:
        spawn_deadline = time.monotonic() + 120
        while not seen and time.monotonic() < spawn_deadline and worker.poll() is None:
            seen.update(_engine_processes_of(worker.pid))
            time.sleep(0.1)
        assert seen, f"the worker spawned no engine process in 120 s (its log: {tmp_path / 'worker.log'})"
        deadline = time.monotonic() + kill_after_spawn_s
        while time.monotonic() < deadline:
            seen.update(_engine_processes_of(worker.pid))
            time.sleep(0.1)
        seen.update(_engine_processes_of(worker.pid))
    finally:
        _kill(worker)
    left = wait_gone(sorted(seen | set(_engine_processes_of(worker.pid))), timeout_s=8)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"engine processes {left} outlived their worker (its log: {tmp_path / 'worker.log'})"
