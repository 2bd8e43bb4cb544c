"""vLLM's scheduler with Skyline's step shape (scheduler/step_budget.py) applied before each step.

vLLM reads its step budget (`max_num_scheduled_tokens`) and per-request prompt
cap (`long_prefill_token_threshold`) afresh at every `schedule()`, so this
subclass sets both from `next_step` over the requests it holds, takes the
looser-tier prompts it holds back out of the running list for that one call,
and otherwise schedules exactly as vLLM does: no copy of vLLM's scheduling
code to drift from it. While held, a prompt cannot be chosen by vLLM's own
preemption for KV space (that step only); the decode worker's KV watermark
keeps the engine away from that point. Loaded in the engine-core process by qualified name
(`scheduler_cls`, set by VllmEngine), with its settings in vLLM's
`additional_config["skyline_step"]`.

vLLM picks `AsyncScheduler` when it runs with async scheduling (GPUs) and
`Scheduler` otherwise (CPU); `make_scheduler` subclasses the one it would
have picked, so setting a scheduler class does not turn async scheduling off.
"""

from __future__ import annotations

import time
from typing import Any

from skyline.scheduler.step_budget import StepShaper
from skyline.workers.engines import vllm_internals

# vLLM's classes (workers/engines/vllm_internals.py: raises, naming the class, if they moved).
Scheduler, AsyncScheduler = vllm_internals.scheduler_classes()

CONFIG_KEY = "skyline_step"
QUALNAME = f"{__name__}.make_scheduler"


class _StepShaping:
    """Mixed into a vLLM scheduler class: reshape each step before vLLM schedules it."""

    def _init_step_shaping(self) -> None:
        settings = (self.vllm_config.additional_config or {}).get(CONFIG_KEY, {})
        self._urgent_priority = int(settings.get("urgent_priority", 0))
        vllm_internals.own_scheduler_config(self)  # the cap is rewritten every step
        # The rule and its state between steps (when strictest-tier work was last here, steps held in a row).
        # The latency step (the engine's own budget is the relaxed step's when that is larger).
        step_tokens = int(settings.get("step_tokens") or 0) or self.max_num_scheduled_tokens
        self._shaper = StepShaper(urgent_priority=self._urgent_priority, step_tokens=step_tokens,
                                  prefill_cap=self.scheduler_config.long_prefill_token_threshold,
                                  background=int(settings.get("background_tokens", 0)),
                                  max_held=int(settings.get("max_held_steps", 0)),
                                  relaxed_tokens=int(settings.get("relaxed_tokens", 0)))

    def schedule(self, *args: Any, **kwargs: Any):
        prompts, decoding = [], 0
        for r in self.running:  # started: vLLM has computed part of the prompt
            left = r.num_prompt_tokens - r.num_computed_tokens
            if left > 0:
                prompts.append((r.priority, left, True))
            else:
                decoding += 1
        # A request waiting for its KV from a prefill engine computes (almost) nothing here.
        prompts.extend((r.priority, r.num_prompt_tokens, False) for r in self.waiting
                       if not vllm_internals.waits_for_remote_kv(r))
        # Some request here (prompt or stream) has latency targets: steps stay short (step_budget.py).
        targeted = not all(map(vllm_internals.asked_for_no_slo, self.running)) or not all(
            map(vllm_internals.asked_for_no_slo, self.waiting))
        shape = self._shaper.shape(prompts, decoding, time.monotonic(), targeted)
        vllm_internals.set_step_shape(self, shape.tokens, shape.prefill_cap)
        if shape.decodes_first:
            vllm_internals.decodes_first(self)
        held = []
        if shape.hold_background:
            # Out of the running list for this one schedule(), their place kept (put back in front).
            held = [r for r in self.running
                    if r.priority > self._urgent_priority and r.num_computed_tokens < r.num_prompt_tokens]
        put_back = vllm_internals.hold_out_of_running(self, held)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            put_back()


class StepShapingScheduler(_StepShaping, Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_step_shaping()


class StepShapingAsyncScheduler(_StepShaping, AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._init_step_shaping()


def make_scheduler(*args: Any, vllm_config: Any, **kwargs: Any):
    """What vLLM calls as its scheduler class: the step-shaping variant of the class it would use."""
    cls = StepShapingAsyncScheduler if vllm_config.scheduler_config.async_scheduling else StepShapingScheduler
    return cls(*args, vllm_config=vllm_config, **kwargs)
