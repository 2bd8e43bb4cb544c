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

from skyline.core import envs as _envs

if _envs.SIM_NATIVE.is_set():  # `skyline simulate` with its compiled modules, before anything imports them
    from skyline.tools.simulate.native import activate as _activate

    _activate(_envs.SIM_NATIVE.get())
