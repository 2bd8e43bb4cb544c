"""Skyline's adjustments to vLLM's engine processes (workers/engines/engine_processes.py) and the
patches behind them (workers/engines/vllm_internals.py), on stand-ins for the vLLM classes they
patch. That vLLM's classes still look the way the patches assume is checked in
tests/test_vllm_contract_engine.py; the effect on real engines in tests/test_e2e_vllm.py."""

from __future__ import annotations

import os
import threading
import time

import pytest

from skyline.workers.engines import engine_processes, vllm_internals


def _in_thread(fn):
    """Run `fn` in a fresh thread (affinity changes stay there) and return what it returned."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell them apart")
def test_building_a_connector_leaves_the_building_thread_on_its_cores():
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))

    class Connector:  # what vLLM's NIXL worker does on CPU: pin the calling thread to the last core
        def __init__(self):
            os.sched_setaffinity(0, {last})
            started = threading.Thread(target=lambda: self.__dict__.setdefault("helper", os.sched_getaffinity(0)))
            started.start()
            started.join()

    def build():
        os.sched_setaffinity(0, {first})  # the engine's OpenMP binding
        c = Connector()
        return os.sched_getaffinity(0), c.helper

    assert _in_thread(build) == ({last}, {last})  # unpatched: the computing thread moved
    vllm_internals.keep_thread_cores(Connector)
    vllm_internals.keep_thread_cores(Connector)  # patching twice wraps once
    assert _in_thread(build) == ({first}, {last})  # back on its core; the connector's thread kept its core


class _Condition:
    """vLLM's SpinCondition, reader side: `wait` yields the core while within `busy_loop_s` of the last read."""

    def __init__(self):
        self.is_reader, self.last_read, self.busy_loop_s = True, time.monotonic(), 1.0
        self.slept = 0

    def wait(self, timeout_ms=None):
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            os.sched_yield()
        else:
            self.slept += 1


def test_a_reader_in_its_busy_window_sleeps_between_looks(monkeypatch):
    """What each look does, counted rather than timed (a CPU-share measurement flaked on a shared
    2-core machine): vLLM's reader yields the core and comes straight back, a patched one sleeps."""

    class Condition(_Condition):
        pass

    yields, sleeps = [], []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    cond = Condition()
    for _ in range(5):
        cond.wait()
    assert len(yields) == 5  # unpatched: every look yields and returns at once (a core spent looking)
    vllm_internals.pause_between_polls(Condition, 200e-6)
    monkeypatch.setattr(vllm_internals.time, "sleep", lambda s: sleeps.append(s))
    cond = Condition()
    for _ in range(5):
        cond.wait()
    assert sleeps == [200e-6] * 5 and len(yields) == 5  # patched: a pause per look, no yield
    cond.last_read -= 10  # past the busy window: vLLM's own wait (sleep on the notification)
    cond.wait(5)
    assert cond.slept == 1 and len(sleeps) == 5


def test_register_patches_only_what_the_environment_asks_for(monkeypatch):
    called = []
    monkeypatch.setattr(vllm_internals, "keep_thread_cores", lambda cls: called.append(("keep", cls.__name__)))
    monkeypatch.setattr(vllm_internals, "pause_between_polls", lambda cls, s: called.append(("pause", s)))
    for env in (engine_processes.ENV, engine_processes.PAUSE_ENV, engine_processes.KEEP_CORES_ENV):
        monkeypatch.delenv(env, raising=False)
    engine_processes.register()
    assert called == []  # other vLLM users get vLLM as it is
    monkeypatch.setenv(engine_processes.PAUSE_ENV, "200")
    monkeypatch.setenv(engine_processes.KEEP_CORES_ENV, "1")
    engine_processes.register()
    assert ("pause", 200e-6) in called and ("keep", "NixlBaseConnectorWorker") in called


def test_a_patch_whose_vllm_class_moved_fails_naming_it(monkeypatch):
    """A vLLM upgrade that moved what a patch touches stops the engine process, instead of running it unpatched."""
    from skyline.core.vllm_contract import SUPPORTED_VLLM, Internal, VllmDrift

    moved = Internal("vllm.distributed.device_communicators.shm_broadcast", "SpinConditionMoved",
                     vllm_internals.SPIN_CONDITION.used_for)
    monkeypatch.setattr(vllm_internals, "SPIN_CONDITION", moved)
    monkeypatch.setenv(engine_processes.PAUSE_ENV, "200")
    monkeypatch.delenv(engine_processes.ENV, raising=False)
    monkeypatch.delenv(engine_processes.KEEP_CORES_ENV, raising=False)
    with pytest.raises(VllmDrift, match="shm_broadcast.SpinConditionMoved") as err:
        engine_processes.register()
    assert SUPPORTED_VLLM in str(err.value) and "docs/vllm-versions.md" in str(err.value)


def test_the_configured_kv_block_reaches_vllms_engine_args():
    """`[engine] kv_block_size` is vLLM's `block_size` (the prefix cache's unit); 0 leaves vLLM's default."""
    from skyline.core.config import EngineConfig
    from skyline.tools.model import resolve_model
    from skyline.workers.main import build_engine

    model = resolve_model("default")
    args = build_engine(EngineConfig(kind="vllm", kv_block_size=32), model)._engine_args()  # type: ignore[attr-defined]
    assert args.block_size == 32
    assert build_engine(EngineConfig(kind="vllm"), model)._engine_args().block_size is None  # type: ignore[attr-defined]
