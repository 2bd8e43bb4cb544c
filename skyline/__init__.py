"""Skyline: SLO-aware, disaggregated LLM serving on vLLM.

The layers, lowest first (tests/test_layers.py keeps them; docs/modules.md maps every module):
  skyline.scheduler   pure policy: tiers, EDF, admission, preemption, step shape (stdlib only)
  skyline.core        what every process shares: messages, keys, config, envs, streams, Redis, timeline
  skyline.gateway     process: the OpenAI front door
  skyline.workers     process: prefill and decode workers around an engine
  skyline.batch       process: the batch runner (its store also serves the gateway's Batch API)
  skyline.tools       operator tools: up, status, trace, model, bench, simulate
  skyline.cli         the one command line that starts any of them
"""

import multiprocessing as _mp

from skyline.core import envs as _envs

# A vLLM process a worker spawned: multiprocessing re-creates the worker's main module (which imports
# Skyline) in it before anything else, marking the process as inheriting meanwhile; it ends with the
# worker from here on (skyline/core/lifetime.py).
if _envs.ENGINE_OWNER_PID.is_set() and getattr(_mp.current_process(), "_inheriting", False):
    from skyline.core.lifetime import engine_process_ends_with_parent as _ends_with_parent

    _ends_with_parent()

if _envs.SIM_NATIVE.is_set():  # `skyline simulate` with its compiled modules, before anything imports them
    from skyline.tools.simulate.native import activate as _activate

    _activate(_envs.SIM_NATIVE.get())
