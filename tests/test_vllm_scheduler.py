"""The vLLM scheduler hook (workers/engines/vllm_scheduler.py) around a stand-in for vLLM's schedule().

What it hands vLLM each step: the budget, the per-request cap and the running list without the
prompts it holds back; and what it restores afterwards. vLLM's own scheduling is not re-tested here
(tests/test_e2e_vllm.py runs the hook in real engines).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from skyline.workers.engines import vllm_scheduler


class _VllmStandIn:
    """Records what schedule() saw, as vLLM's Scheduler would read it."""

    def schedule(self):
        self.seen = (list(self.running), self.max_num_scheduled_tokens,
                     self.scheduler_config.long_prefill_token_threshold)
        self.running.append(SimpleNamespace(name="admitted-now", priority=0, num_prompt_tokens=9,
                                            num_computed_tokens=0, status=None,
                                            sampling_params=None))  # vLLM may change the list
        return "scheduler output"


class _Shaped(vllm_scheduler._StepShaping, _VllmStandIn):
    def __init__(self, max_held: int = 16, relaxed: int = 0):
        self.vllm_config = SimpleNamespace(additional_config={vllm_scheduler.CONFIG_KEY: {
            "background_tokens": 128, "max_held_steps": max_held, "urgent_priority": 0,
            "step_tokens": 256, "relaxed_tokens": relaxed}})
        self.max_num_scheduled_tokens = max(256, relaxed)  # the engine is built for the longest step
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=224)
        self._init_step_shaping()


def _req(name, priority, prompt, computed, status=None, best_effort=False):
    from skyline.workers.engines.vllm_internals import BEST_EFFORT_ARG

    params = SimpleNamespace(extra_args={BEST_EFFORT_ARG: True} if best_effort else None)
    return SimpleNamespace(name=name, priority=priority, num_prompt_tokens=prompt, num_computed_tokens=computed,
                           status=status, sampling_params=params)


def test_long_steps_while_every_request_in_the_engine_asked_for_no_slo():
    s = _Shaped(relaxed=2048)
    s.running = [_req("rag", 1, 1500, 384, best_effort=True), _req("stream", 1, 80, 95, best_effort=True)]
    s.waiting = [_req("next", 1, 1024, 0, best_effort=True)]
    s.schedule()
    assert s.seen[1:] == (2048, 0)  # vLLM's own budget, no per-request cap
    s.running = [r for r in s.running if r.name != "admitted-now"]
    s.waiting = [_req("chat", 1, 60, 0)]  # one with targets arrives: short steps from the next one on
    s.schedule()
    assert s.seen[1:] == (256, 224)


def test_a_waiting_chat_steps_with_the_decodes_while_the_started_rag_prompt_sits_out():
    s = _Shaped()
    rag, decoding = _req("rag", 1, 1500, 384), _req("decoding", 0, 80, 95)
    s.running, s.waiting = [rag, decoding], [_req("chat", 0, 60, 0)]
    assert s.schedule() == "scheduler output"
    running_seen, budget, cap = s.seen
    assert [r.name for r in running_seen] == ["decoding"]
    assert (budget, cap) == (61, 0)  # the chat's 60 tokens + one decode token; a lone chat uncapped
    # Put back in front, after whatever vLLM did to the list.
    assert [r.name for r in s.running] == ["rag", "decoding", "admitted-now"]


def test_background_steps_and_the_bound_on_holding():
    s = _Shaped(max_held=2)
    rag, decoding = _req("rag", 1, 1500, 384), _req("decoding", 0, 80, 95)
    s.running, s.waiting = [rag, decoding], []
    s.schedule()
    assert s.seen[1:] == (256, 224)  # no strictest-tier prompt seen yet: vLLM's full step
    s.running = [rag, decoding]
    s._shaper.last_urgent_s = time.monotonic() - 5  # one was here 5 s ago
    s.schedule()
    # Only the RAG prompt: 128 of it + one decode token, the decode first in vLLM's order.
    assert s.seen[1:] == (129, 128) and [r.name for r in s.seen[0]] == ["decoding", "rag"]
    s.running = [rag, decoding]
    s.running, s.waiting = [rag, decoding], [_req("chat", 0, 600, 0)]
    names = []
    for _ in range(3):
        s.running = [r for r in s.running if r.name != "admitted-now"]
        s.schedule()
        names.append([r.name for r in s.seen[0]])
    # Held twice in a row, then one step shared with it (vLLM's budget, cap and order), then held again.
    assert names == [["decoding"], ["decoding"], ["rag", "decoding"]]
    assert s.seen[1:] == (256, 224)
    s.running = [r for r in s.running if r.name != "admitted-now"]
    s.schedule()
    assert [r.name for r in s.seen[0]] == ["decoding"]


def test_a_request_waiting_for_its_kv_from_a_prefill_engine_holds_nothing_back():
    from vllm.v1.request import RequestStatus

    s = _Shaped()
    s._shaper.last_urgent_s = time.monotonic() - 5
    rag = _req("rag", 1, 1500, 384)
    pulling = _req("pulling", 0, 300, 0, status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    s.running, s.waiting = [rag], [pulling]
    s.schedule()
    assert [r.name for r in s.seen[0]] == ["rag"] and s.seen[1:] == (128, 128)  # a background step
