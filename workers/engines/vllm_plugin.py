"""A vLLM general plugin (entry point `vllm.general_plugins`): a NIXL progress thread that sleeps.

NIXL's Python API creates every agent with `pthrDelay = 0`: its progress
thread polls UCX in a tight loop. Measured here, an idle vLLM CPU engine with
the NIXL connector burned 100% of a core; with engines pinned one per core
that thread halves the engine's compute and starves Redis and the control
plane. The thread cannot simply be disabled: over TCP/shared memory the side
that *serves* a KV read (the prefill engine, often idle) must keep progressing
UCX or the decode engine's pull never completes (seen here: it hung).

So the thread keeps running but pauses `SKYLINE_NIXL_PROGRESS_DELAY_US`
microseconds between polls. vLLM loads general plugins in every engine
process, the only way to reach the worker process that builds the agent; the
patch applies only when that variable is set (VllmEngine sets it for CPU KV
buffers), so installing Skyline changes nothing for other vLLM users.
"""

from __future__ import annotations

import os

ENV = "SKYLINE_NIXL_PROGRESS_DELAY_US"


def register() -> None:
    delay = os.environ.get(ENV)
    if not delay:
        return
    try:
        import nixl._api as api  # the CUDA-major-specific backend module
    except ImportError:
        return
    real = api.nixlBind
    if getattr(real, "_skyline_delay", None) is not None:
        return  # already patched in this process
    api.nixlBind = _DelayedBind(real, int(delay))


class _DelayedBind:
    """The NIXL binding module with `nixlAgent` setting the progress-thread delay."""

    def __init__(self, real, delay_us: int):
        self._real = real
        self._skyline_delay = delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - mirrors the binding's name
        config.pthrDelay = self._skyline_delay
        return self._real.nixlAgent(name, config)
