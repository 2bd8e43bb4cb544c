"""Skyline's adjustments to vLLM's engine processes, registered as a vLLM general plugin (entry point
`vllm.general_plugins`, `skyline_engine_processes`): the parent-death signal, and CPU engines that keep
to their cores.

vLLM loads general plugins in every process it starts (and in the worker's own), the only way
to reach the engine-core and executor processes. The patches themselves are vLLM internals and
live in workers/engines/vllm_internals.py: one that moved raises there, naming it, so an engine
fails to start instead of running unpatched.

Three things in a vLLM CPU engine take cores from the engines on a host whose
cores are all computing: two threads that poll in a loop, and the NIXL
connector moving the thread that computes. Each patch applies only when its
environment variable is set (VllmEngine sets them for CPU engines), so
installing Skyline changes nothing for other vLLM users. (`skyline bench`
gives its `vllm serve` baselines the second patch too: the comparison is of
the serving layer, not of this fix.)

1. The NIXL progress thread.

NIXL's Python API creates every agent with `pthrDelay = 0`: its progress
thread polls UCX in a tight loop. Measured here, an idle vLLM CPU engine with
the NIXL connector burned 100% of a core; with engines pinned one per core
that thread halves the engine's compute and starves Redis and the control
plane. The thread cannot simply be disabled: over TCP/shared memory the side
that *serves* a KV read (the prefill engine, often idle) must keep progressing
UCX or the decode engine's pull never completes (seen here: it hung).

So the thread keeps running but pauses `SKYLINE_NIXL_PROGRESS_DELAY_US`
microseconds between polls. vLLM loads general plugins in every engine
process, the only way to reach the worker process that builds the agent.

2. The shared-memory message queues between vLLM's engine-core process and
its model-executor process (the CPU platform always uses the multiprocess
executor). A reader of a queue spins on `sched_yield()` for a second after its
last message before it sleeps on a ZeroMQ notification
(`shm_broadcast.SpinCondition`, `busy_loop_s = 1`): a busy engine's core
process waits for every step's result that way and never sleeps (74% of a
core measured here, for one engine alone). With `SKYLINE_SHM_POLL_PAUSE_US`
set, a reader in that busy second sleeps that long between looks instead of
yielding: the same loop, so nothing else changes, at a wake-up delay of that
many microseconds per message. (Cutting the busy second to zero instead, so
readers always wait for the notification, stalled batched steps for ~5 s:
a notification can be lost while one is still queued.)

3. The NIXL connector's worker, on CPU, pins the thread that builds it to the
last core of each NUMA node (`os.sched_setaffinity(0, ...)`, "reserve
different cores for start_load_kv() from model_forward()"). That thread is
the executor's main thread, OpenMP's master: with one OpenMP thread it is the
one that computes. So every CPU engine with the connector computed on the
host's last core whatever `VLLM_CPU_OMP_THREADS_BIND` said: measured here, a
prefill engine bound to core 0 and a decode engine bound to core 1 both ran
on core 1 (what looked like a 2.2x "neighbour slowdown", and prefill steps
in the fleet 5-6x their time alone), while core 0 served the pollers. With
`SKYLINE_NIXL_KEEP_CORES` set, the thread gets its cores back once the
connector is built; threads the connector started meanwhile (NIXL's progress
thread) keep the reserved core, as vLLM intended.

And one thing that is not about cores: in the engine processes a Skyline worker spawns (marked
`SKYLINE_ENGINE_OWNER_PID`), the kernel sends SIGKILL when the process's parent dies, so no
engine outlives a worker killed with SIGKILL (skyline/core/lifetime.py).
"""

from __future__ import annotations

import logging
import os

from skyline.core import envs
from skyline.core.lifetime import engine_process_ends_with_parent
from skyline.workers.engines import vllm_internals

log = logging.getLogger("skyline.engine.vllm")

ENV = envs.NIXL_PROGRESS_DELAY_US.name
PAUSE_ENV = envs.SHM_POLL_PAUSE_US.name
KEEP_CORES_ENV = envs.NIXL_KEEP_CORES.name
POLL_PAUSE_US = "200"  # for CPU engines: Skyline's, and the vLLM baselines of `skyline bench`


def register() -> None:
    engine_process_ends_with_parent()  # no engine process outlives the worker that started it
    _sleeping_progress_thread()
    _sleeping_queue_readers()
    _connector_keeps_engine_cores()


def _connector_keeps_engine_cores() -> None:
    if not envs.NIXL_KEEP_CORES.is_set():
        return
    if not hasattr(os, "sched_setaffinity"):
        # Optional by platform: without thread affinity (not Linux) nothing pins the thread either.
        log.info("%s set, but this platform has no thread affinity: nothing to keep", KEEP_CORES_ENV)
        return
    vllm_internals.keep_cores_while_nixl_worker_builds()


def _sleeping_queue_readers() -> None:
    value = envs.SHM_POLL_PAUSE_US.get()
    if value:
        vllm_internals.pause_shm_queue_readers(int(value) / 1e6)


def _sleeping_progress_thread() -> None:
    delay = envs.NIXL_PROGRESS_DELAY_US.get()
    if delay:
        vllm_internals.delay_nixl_progress_thread(int(delay))
