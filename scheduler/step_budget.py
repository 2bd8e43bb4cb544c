"""The shape of an engine's next step: short steps while only looser-tier prompts compute.

An engine takes a new request, an abort or a priority change only between
steps, so a request of the strictest tier arriving at a busy engine first waits
for the step in progress, however urgent it is. That step is as long as its
tokens: measured on the 2-core CPU engines, a step holding a 224-token chunk of
a RAG prompt took 200-280 ms, half of a 574 ms chat TTFT target, before the
chat's own step even began (BENCHMARKS.md, "The step cap at 7/8 of the step").

So while every prompt in the engine belongs to a looser tier, a step carries
at most `background_tokens` of prompt (shared between those prompts) plus one
token for each running decode, which never waits for it; as soon as a prompt
of the strictest tier is there, the engine steps its full budget again, so that
prompt goes through in as few steps as it can. The price is paid by background
prompts only: more, shorter steps, each with the step's fixed cost (~40 ms on
the CPU engines, a few ms on a GPU).

Pure: the vLLM scheduler hook (workers/engines/vllm_scheduler.py) and the
simulator both call `next_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    tokens: int  # the step's token budget (vLLM max_num_batched_tokens for this step)
    prefill_cap: int  # most prompt tokens one request may take in it (long_prefill_token_threshold; 0 = none)


def background_tokens(setting: int, step_tokens: int) -> int:
    """The configured background step (engine.background_step_tokens) as tokens: -1 = half the step, 0 = off."""
    if setting < 0:
        return step_tokens // 2
    return setting


def next_step(prefill_priorities: Sequence[int], decoding: int, *, urgent_priority: int, step_tokens: int,
              prefill_cap: int, background: int) -> StepShape:
    """The budget and per-request prompt cap of the engine's next step.

    `prefill_priorities`: the engine priority of every request with prompt tokens
    left to compute (running chunks and waiting prompts); `decoding`: running
    requests past their prompt (one token each); `urgent_priority`: the strictest
    tier's priority (lower is more urgent, as in vLLM); `step_tokens` and
    `prefill_cap`: the engine's own budget and cap; `background`: prompt tokens
    of a step that holds only looser-tier prompts (0 = always the full step).
    """
    full = StepShape(step_tokens, prefill_cap)
    if background <= 0 or background >= step_tokens or not prefill_priorities:
        return full
    if min(prefill_priorities) <= urgent_priority:
        return full
    # Each background prompt gets an equal share, so that whatever the engine's order of
    # requests, the decodes' tokens are left in the budget.
    share = max(1, background // len(prefill_priorities))
    cap = min(share, prefill_cap) if prefill_cap > 0 else share
    return StepShape(min(step_tokens, background + decoding), cap)
