"""The vLLM plugin's patches for CPU engines (workers/engines/vllm_plugin.py), on stand-ins for the
vLLM classes they patch, plus a check that vLLM's classes still look the way the patches assume.
The effect on real engines is checked in tests/test_e2e_vllm.py."""

from __future__ import annotations

import inspect
import os
import threading
import time

import pytest

from skyline.workers.engines import vllm_plugin


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
    vllm_plugin.keep_thread_cores(Connector)
    vllm_plugin.keep_thread_cores(Connector)  # patching twice wraps once
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
    vllm_plugin.pause_between_polls(Condition, 200e-6)
    monkeypatch.setattr(vllm_plugin.time, "sleep", lambda s: sleeps.append(s))
    cond = Condition()
    for _ in range(5):
        cond.wait()
    assert sleeps == [200e-6] * 5 and len(yields) == 5  # patched: a pause per look, no yield
    cond.last_read -= 10  # past the busy window: vLLM's own wait (sleep on the notification)
    cond.wait(5)
    assert cond.slept == 1 and len(sleeps) == 5


def test_register_patches_only_what_the_environment_asks_for(monkeypatch):
    called = []
    monkeypatch.setattr(vllm_plugin, "keep_thread_cores", lambda cls: called.append(("keep", cls.__name__)))
    monkeypatch.setattr(vllm_plugin, "pause_between_polls", lambda cls, s: called.append(("pause", s)))
    for env in (vllm_plugin.ENV, vllm_plugin.PAUSE_ENV, vllm_plugin.KEEP_CORES_ENV):
        monkeypatch.delenv(env, raising=False)
    vllm_plugin.register()
    assert called == []  # other vLLM users get vLLM as it is
    pytest.importorskip("vllm")
    monkeypatch.setenv(vllm_plugin.PAUSE_ENV, "200")
    monkeypatch.setenv(vllm_plugin.KEEP_CORES_ENV, "1")
    vllm_plugin.register()
    assert ("pause", 200e-6) in called and ("keep", "NixlBaseConnectorWorker") in called


def test_vllm_classes_still_look_as_the_patches_assume():
    """A vLLM upgrade that renames what the patches touch must fail here, not silently unpatch."""
    shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    base_worker = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    init, wait = inspect.getsource(shm.SpinCondition.__init__), inspect.getsource(shm.SpinCondition.wait)
    assert all(name in init for name in ("self.is_reader", "self.last_read", "self.busy_loop_s"))
    assert "sched_yield()" in wait and "busy_loop_s" in wait
    assert "sched_setaffinity(0" in inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)


def test_the_configured_kv_block_reaches_vllms_engine_args():
    """`[engine] kv_block_size` is vLLM's `block_size` (the prefix cache's unit); 0 leaves vLLM's default."""
    from skyline.core.config import EngineConfig
    from skyline.tools.model import resolve_model
    from skyline.workers.main import build_engine

    model = resolve_model("default")
    args = build_engine(EngineConfig(kind="vllm", kv_block_size=32), model)._engine_args()  # type: ignore[attr-defined]
    assert args.block_size == 32
    assert build_engine(EngineConfig(kind="vllm"), model)._engine_args().block_size is None  # type: ignore[attr-defined]
