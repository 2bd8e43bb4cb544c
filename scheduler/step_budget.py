"""The shape of an engine's next step, by tier: short steps for background prompts, none while urgent ones wait.

An engine takes a new request, an abort or a priority change only between
steps, so a request of the strictest tier arriving at a busy engine first waits
for the step in progress, however urgent it is. That step is as long as its
tokens: a step holding a long prompt's chunk can use up a large share of a
chat's TTFT target before the chat's own step even begins (BENCHMARKS.md,
"The step cap at 7/8 of the step").

Two rules, one per situation:

  - Background steps: while every prompt in the engine belongs to a looser tier,
    a step carries at most `background` prompt tokens (of one prompt at a time)
    plus one token for each running decode, which never waits for it. The
    price: more, shorter steps for background prompts, each with the step's
    fixed cost (large on CPU engines, small on a GPU); so only on an
    engine that has seen strictest-tier work in the last `URGENT_MEMORY_S`.
  - Holding: while a prompt of the strictest tier has tokens left, the looser
    prompts the engine has started sit out (they keep their KV blocks and
    their progress; nothing is recomputed) and the step carries only the
    strictest tier's prompt tokens and the decodes. vLLM itself gives each
    step to the requests it already runs before a newcomer, whatever their
    priorities, so a chat behind a RAG prompt gets only what the RAG's chunk
    leaves of the step (32 tokens beside a 224-token chunk in a 256-token step:
    two or three full steps for a 60-token chat); and a step longer than the
    chat's own tokens delays its first token, which comes only at the end of
    the step. At most `max_held` steps in a row, then one shared step: a flood
    of chats slows background prompts but cannot starve them.

And one for throughput: while every request in the engine asked for no SLO (best effort, as a
`vllm serve` client) and none with targets has been in it for `URGENT_MEMORY_S`, a step takes
`relaxed_tokens` (vLLM's own default budget) with no per-request cap. Small steps exist to bound
what an urgent newcomer waits for and what a prompt adds to running streams' TPOT; with no target
in sight they only pay the step's fixed cost more often.

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
    hold_background: bool = False  # started looser-tier prompts sit this step out
    decodes_first: bool = False  # running decodes take their token before any prompt takes the rest


# Background steps are worth their cost only where strictest-tier work arrives: an engine that has
# not seen any for this long steps full again (a fleet serving one tier pays nothing).
URGENT_MEMORY_S = 30.0


def expecting_urgent(last_urgent_s: float | None, now_s: float) -> bool:
    """Has the engine seen a strictest-tier prompt recently enough to keep background steps short?"""
    return last_urgent_s is not None and now_s - last_urgent_s < URGENT_MEMORY_S


def background_tokens(setting: int, step_tokens: int, role: str = "decode") -> int:
    """The configured background step (engine.background_step_tokens) as tokens for an engine of a
    worker of `role`: -1 = half the step on decode workers and off on prefill workers, 0 = off.

    Why not on prefill workers by default: there every step is prompt work, so short steps only add
    the step's fixed cost to background prompts, and with conditional disaggregation short interactive
    prompts are computed on decode workers anyway; holding still applies there."""
    if setting < 0:
        return step_tokens // 2 if role in ("decode", "elastic") else 0  # engines that run streams
    return setting


def next_step(prompts: Sequence[tuple[int, int]], decoding: int, *, urgent_priority: int, step_tokens: int,
              prefill_cap: int, background: int, held: int = 0, max_held: int = 0) -> StepShape:
    """The budget, per-request prompt cap and holding of the engine's next step.

    `prompts`: (engine priority, prompt tokens left) of every request with prompt
    tokens to compute (running chunks and waiting prompts); `decoding`: running
    requests past their prompt (one token each); `urgent_priority`: the strictest
    tier's priority (lower is more urgent, as in vLLM); `step_tokens` and
    `prefill_cap`: the engine's own budget and cap; `background`: prompt tokens of
    a step that holds only looser-tier prompts (0 = full steps); `held`: steps in a
    row that held looser prompts back so far; `max_held`: the most in a row (0 =
    never hold).
    """
    full = StepShape(step_tokens, prefill_cap)
    if not prompts:
        return full
    urgent = [left for priority, left in prompts if priority <= urgent_priority]
    if urgent:
        if len(urgent) == len(prompts) and max_held > 0:
            # Only strictest-tier prompts: vLLM's cap (there so a newcomer can share the step with a
            # long running prompt) would only split a lone one over two steps beside the decodes.
            return StepShape(step_tokens, prefill_cap if len(urgent) > 1 else 0)
        if max_held <= 0 or held >= max_held:
            return full
        # Only the strictest tier's prompts and the decodes: no leftover budget for a looser
        # prompt waiting to start, whose tokens would only lengthen the step.
        tokens = min(step_tokens, decoding + sum(urgent))
        return StepShape(tokens, prefill_cap if len(urgent) > 1 else 0, hold_background=True)
    if background <= 0 or background >= step_tokens:
        return full
    # One background prompt at a time, in the engine's order (the first started finishes first, as
    # in full steps; shared, they would all finish late together); the engine must schedule the
    # decodes first so that their tokens are left in the budget (`decodes_first`).
    cap = min(background, prefill_cap) if prefill_cap > 0 else background
    return StepShape(min(step_tokens, background + decoding), cap, decodes_first=True)


class StepShaper:
    """One engine's step shape, step after step: `next_step` with the state it keeps between steps.

    The state: when a strictest-tier prompt was last in the engine (`last_urgent_s`: background steps
    only while `expecting_urgent`) and how many steps in a row held started looser-tier prompts back
    (`held`: bounded by `max_held`). The vLLM scheduler hook (workers/engines/vllm_scheduler.py) and
    the simulated engines (skyline/tools/simulate/prefill_worker.py, decode_worker.py) each keep one per
    engine and ask it before every step, the ones that compute only decodes included (their shape
    is the full step and they end a run of held steps).
    """

    __slots__ = ("_memo", "background", "full", "held", "last_targeted_s", "last_urgent_s", "max_held",
                 "prefill_cap", "relaxed", "step_tokens", "urgent_priority")

    def __init__(self, *, urgent_priority: int, step_tokens: int, prefill_cap: int, background: int = 0,
                 max_held: int = 0, relaxed_tokens: int = 0):
        self.urgent_priority, self.step_tokens, self.prefill_cap = urgent_priority, step_tokens, prefill_cap
        self.background, self.max_held = background, max_held
        self.full = StepShape(step_tokens, prefill_cap)
        # The step while only best-effort work is in sight (None: off, or no larger than the full step).
        self.relaxed = StepShape(relaxed_tokens, 0) if relaxed_tokens > step_tokens else None
        self.held = 0  # steps in a row that held started looser-tier prompts back
        self.last_urgent_s: float | None = None  # when a strictest-tier prompt was last in the engine
        self.last_targeted_s: float | None = None  # when a request with latency targets was last in it
        self._memo: dict = {}

    def shape(self, prompts: Sequence[tuple[int, int, bool]], decoding: int, now_s: float,
              targeted: bool = True) -> StepShape:
        """The next step's shape. `prompts`: (engine priority, prompt tokens left, started) of every request
        with prompt tokens to compute, `started` when the engine has computed part of it (vLLM's running
        list; a waiting prompt's tokens left are its whole prompt: the engine finds its prefix-cache hits
        when it schedules it); `decoding`: running requests past their prompt; `now_s`: the engine's clock;
        `targeted`: some request in the engine (prompt or decode) has latency targets (False: all are
        best effort, and relaxed steps apply once none with targets was here for `URGENT_MEMORY_S`)."""
        if targeted:
            self.last_targeted_s = now_s
        elif self.relaxed is not None and not expecting_urgent(self.last_targeted_s, now_s):
            self.held = 0
            return self.relaxed
        urgent = self.urgent_priority
        if any(p[0] <= urgent for p in prompts):
            self.last_urgent_s = now_s
        background = self.background if expecting_urgent(self.last_urgent_s, now_s) else 0
        shape = next_step([(p[0], p[1]) for p in prompts], decoding, urgent_priority=urgent,
                          step_tokens=self.step_tokens, prefill_cap=self.prefill_cap, background=background,
                          held=self.held, max_held=self.max_held)
        # The step holds back the started looser-tier prompts (a waiting one is simply not started).
        held_back = shape.hold_background and any(p[2] and p[0] > urgent for p in prompts)
        self.held = self.held + 1 if held_back else 0
        return shape

    def one_priority(self, priority: int, prompts: int, decoding: int, now_s: float) -> StepShape:
        """`shape` for an engine whose `prompts` prompts all have one `priority` (a fleet serving one tier:
        the simulator's hot path). Nothing is held back then and the prompts' sizes do not enter the
        answer, so `shape`'s answers are memoised by what does."""
        if not prompts:
            priority = self.urgent_priority + 1  # no prompt: the answer depends on nothing of theirs
        if priority <= self.urgent_priority:
            self.last_urgent_s = now_s
            background = False
        else:
            background = self.background > 0 and expecting_urgent(self.last_urgent_s, now_s)
        key = (priority, min(prompts, 2), background, decoding if background else -1)
        shape = self._memo.get(key)
        if shape is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            shape = self._memo[key] = self.shape([(priority, 1, False)] * prompts, decoding, now_s)
        self.held = 0
        return shape
