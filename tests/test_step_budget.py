"""The engine's step shape by tier (scheduler/step_budget.py) and what the preemption check makes of it."""

from skyline.scheduler.preemption import PreemptionPolicy, Running, Waiting, choose_victims, tokens_until_done
from skyline.scheduler.step_budget import URGENT_MEMORY_S, StepShape, background_tokens, expecting_urgent, next_step

ENGINE = {"urgent_priority": 0, "step_tokens": 256, "prefill_cap": 224, "background": 128, "max_held": 16}


def test_background_setting_resolves_against_the_step_and_the_role():
    assert background_tokens(-1, 256, "decode") == 128
    assert background_tokens(-1, 256, "prefill") == 0  # the default: off on prefill workers
    assert background_tokens(0, 256, "decode") == 0
    assert background_tokens(96, 256, "prefill") == 96


def test_background_steps_only_where_the_strictest_tier_was_seen_lately():
    assert expecting_urgent(100.0, 100.0 + URGENT_MEMORY_S - 1)
    assert not expecting_urgent(100.0, 100.0 + URGENT_MEMORY_S)
    assert not expecting_urgent(None, 5.0)


def test_only_looser_tier_prompts_get_a_short_step_with_room_for_every_decode():
    bg = {"decodes_first": True}
    # One RAG prompt (priority 1, 1,400 tokens left) beside 5 decodes: 128 prompt tokens + 5 decode tokens.
    assert next_step([(1, 1400)], 5, **ENGINE) == StepShape(133, 128, **bg)
    # Alone it gets the background budget too (vLLM lifts the cap for a request alone; the budget holds).
    assert next_step([(1, 1400)], 0, **ENGINE) == StepShape(128, 128, **bg)
    # Two background prompts: one at a time (the first in the engine's order takes the 128 tokens).
    assert next_step([(2, 900), (1, 1400)], 3, **ENGINE) == StepShape(131, 128, **bg)
    # Many decodes: never more than the engine's own budget.
    assert next_step([(1, 1400)], 500, **ENGINE) == StepShape(256, 128, **bg)


def test_a_strictest_tier_prompt_steps_alone_with_the_decodes_while_looser_ones_are_held():
    held = StepShape(5 + 60, 0, hold_background=True)
    assert next_step([(1, 1400), (0, 60)], 5, **ENGINE) == held
    # Several strictest-tier prompts: their tokens, each at most the engine's cap.
    assert next_step([(1, 1400), (0, 60), (0, 300)], 5, **ENGINE) == StepShape(256, 224, hold_background=True)
    # At the bound (16 held steps in a row) one full step shared with them; never held when off.
    assert next_step([(1, 1400), (0, 60)], 5, **{**ENGINE, "held": 16}) == StepShape(256, 224)
    assert next_step([(1, 1400), (0, 60)], 5, **{**ENGINE, "max_held": 0}) == StepShape(256, 224)
    # Nothing to hold: a full step, without the cap for a lone strictest-tier prompt (a 250-token chat
    # beside 5 decodes in one step, not 224 + 26), with it for several (a newcomer shares the step).
    assert next_step([(0, 250)], 5, **ENGINE) == StepShape(256, 0)
    assert next_step([(0, 250), (0, 60)], 5, **ENGINE) == StepShape(256, 224)
    assert next_step([(0, 250)], 5, **{**ENGINE, "max_held": 0}) == StepShape(256, 224)  # vLLM's own way


def test_full_step_without_prompts_or_when_off():
    assert next_step([], 7, **ENGINE) == StepShape(256, 224)  # decodes only
    assert next_step([(1, 1400)], 5, **{**ENGINE, "background": 0}) == StepShape(256, 224)
    assert next_step([(1, 1400)], 5, **{**ENGINE, "background": 256}) == StepShape(256, 224)  # not shorter
    # An engine without a cap of its own still caps a background prompt at the background step.
    assert next_step([(1, 1400)], 5, **{**ENGINE, "prefill_cap": 0}) == StepShape(133, 128, decodes_first=True)
    # Never more than the engine's own cap.
    assert next_step([(1, 1400)], 5, **{**ENGINE, "prefill_cap": 100}) == StepShape(133, 100, decodes_first=True)


def test_preemption_counts_a_background_step_in_progress_as_short():
    # After a 128-token step in progress, a 74-token chat shares the next 256-token step.
    assert tokens_until_done([1000], 74, 256, 128, in_progress=128) == 128 + 128 + 74
    assert tokens_until_done([1000], 74, 256, 128, in_progress=0) == 256 + 128 + 74
    # A 1,000 ms deadline at 400 tokens/s leaves 400 tokens: the full step in progress (256 + 128 + 74 = 458)
    # does not fit, the background one (128 + 128 + 74 = 330) does.
    rag = [Running("rag", 1, 60_000, 1500, 0)]
    chat = Waiting(0, 1_000, 74)
    full = PreemptionPolicy(step_tokens=256, prefill_cap=128)
    assert choose_victims(full, rag, chat, 0, 400) == ["rag"]
    assert choose_victims(PreemptionPolicy(step_tokens=256, prefill_cap=128, background_tokens=128),
                          rag, chat, 0, 400) == []
    # A strictest-tier prompt running makes the step in progress a full one again: with a 10-token
    # chat in the engine beside the RAG prompt, 256 + 10 + 128 + 74 = 468 tokens > 400 (a background
    # step would make it 340, which fits).
    both = [Running("chat0", 0, 800, 10, 0), *rag]
    policy = PreemptionPolicy(step_tokens=256, prefill_cap=128, background_tokens=128)
    assert choose_victims(policy, both, chat, 0, 400) == ["rag"]


def test_no_victims_for_a_claimed_strictest_tier_request_on_an_engine_that_holds():
    """Holding, the engine gives a claimed chat every step after the one in progress: aborting the
    RAG prompt would only cost its recompute. A chat still queued because the worker is full needs
    the room an abort makes."""
    rag = [Running("rag", 1, 60_000, 1500, 0)]
    chat = Waiting(0, 1_000, 74)
    holds = PreemptionPolicy(step_tokens=256, prefill_cap=224, background_tokens=128, holds_background=True)
    assert choose_victims(holds, rag, chat, 0, 400) == []
    assert choose_victims(holds, rag, chat, 0, 400, head_claimed=False) == ["rag"]
    # A looser-tier head is not held for: the usual check.
    batch_rag = [Running("rag", 2, 60_000, 1500, 0)]
    assert choose_victims(holds, batch_rag, Waiting(1, 1_000, 74), 0, 400) == ["rag"]


def test_relaxed_steps_only_while_every_request_in_sight_asked_for_no_slo():
    from skyline.scheduler.step_budget import StepShaper

    shaper = StepShaper(urgent_priority=0, step_tokens=256, prefill_cap=224, background=128, max_held=16,
                        relaxed_tokens=2048)
    best_effort = [(1, 1024, True), (1, 1024, False)]
    # Only best-effort work, none with targets ever seen: vLLM's own budget, no per-request cap.
    assert shaper.shape(best_effort, 3, 0.0, targeted=False) == StepShape(2048, 0)
    # A request with targets in the engine (prompt or decode): latency steps, as before.
    assert shaper.shape(best_effort, 3, 1.0, targeted=True) == StepShape(256, 224)
    # ... and for URGENT_MEMORY_S after it left, since more like it are likely on their way.
    assert shaper.shape(best_effort, 3, 1.0 + URGENT_MEMORY_S - 1, targeted=False).tokens <= 256
    assert shaper.shape(best_effort, 3, 1.0 + URGENT_MEMORY_S + 1, targeted=False) == StepShape(2048, 0)
    # Off (0), or no larger than the latency step: every step is the latency step.
    for relaxed in (0, 256):
        off = StepShaper(urgent_priority=0, step_tokens=256, prefill_cap=224, relaxed_tokens=relaxed)
        assert off.shape(best_effort, 3, 0.0, targeted=False) == StepShape(256, 224)
