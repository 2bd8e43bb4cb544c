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
    from skyline.workers.engines.vllm_plugin import register
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
