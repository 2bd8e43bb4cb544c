"""The vLLM scheduler hook (workers/engines/vllm_scheduler.py) around a stand-in for vLLM's schedule().

What it hands vLLM each step: the budget, the per-request cap and the running list without the
prompts it holds back; and what it restores afterwards. vLLM's own scheduling is not re-tested here
(tests/test_e2e_vllm.py runs the hook in real engines); the last test runs the hook in vLLM's own
Scheduler (built without a model runner), where holding a prompt meets vLLM's LoRA slot accounting.
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
                                            sampling_params=None, lora_request=None))  # vLLM may change the list
        return "scheduler output"


class _Shaped(vllm_scheduler._StepShaping, _VllmStandIn):
    def __init__(self, max_held: int = 16, relaxed: int = 0):
        self.vllm_config = SimpleNamespace(additional_config={vllm_scheduler.CONFIG_KEY: {
            "background_tokens": 128, "max_held_steps": max_held, "urgent_priority": 0,
            "step_tokens": 256, "relaxed_tokens": relaxed}})
        self.max_num_scheduled_tokens = max(256, relaxed)  # the engine is built for the longest step
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=224)
        self.lora_config = None
        self._init_step_shaping()


def _req(name, priority, prompt, computed, status=None, best_effort=False):
    from skyline.workers.engines.vllm_internals import BEST_EFFORT_ARG

    params = SimpleNamespace(extra_args={BEST_EFFORT_ARG: True} if best_effort else None)
    return SimpleNamespace(name=name, priority=priority, num_prompt_tokens=prompt, num_computed_tokens=computed,
                           status=status, sampling_params=params, lora_request=None)


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


# -- in vLLM's own scheduler ---------------------------------------------------------------------


def _real_scheduler(max_loras: int):
    """vLLM's Scheduler with the hook, as an engine core builds it (no model runner: each step's output
    is made up below), with LoRA on and the latency step's settings of the stand-in above."""
    import torch
    from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from skyline.tools.model import resolve_model

    model = ModelConfig(model=resolve_model("default"), dtype="float32", max_model_len=2048)
    sched = SchedulerConfig(max_model_len=2048, is_encoder_decoder=False, max_num_batched_tokens=2048,
                            max_num_seqs=16, long_prefill_token_threshold=224, policy="priority",
                            async_scheduling=False)
    cache = CacheConfig(block_size=16, enable_prefix_caching=False)
    cache.num_gpu_blocks = 1000
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=8),
                        additional_config={vllm_scheduler.CONFIG_KEY: {
                            "background_tokens": 128, "max_held_steps": 16, "urgent_priority": 0,
                            "step_tokens": 256}})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return vllm_scheduler.make_scheduler(vllm_config=config, kv_cache_config=kv,
                                         structured_output_manager=StructuredOutputManager(config), block_size=16)


def _real_request(rid: str, prompt: int, adapter: int, priority: int):
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, prompt_token_ids=list(range(1, prompt + 1)), sampling_params=SamplingParams(max_tokens=8),
                   pooling_params=None, lora_request=LoRARequest(f"adapter-{adapter}", adapter, "/unused"),
                   priority=priority, arrival_time=time.time())


def _step(s) -> dict[str, int]:
    """One schedule() and a made-up model output (one token for each request past its prompt)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else [] for r in ids]
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=sampled))
    return dict(out.num_scheduled_tokens)


def test_a_held_prompt_keeps_its_lora_slot_in_vllms_scheduler():
    """Two slots: the RAG prompt (adapter 1) held out of the step for a chat keeps its slot, so the chat
    on a third adapter waits for the decoding stream's (adapter 2) instead of being admitted beside both
    (vLLM then asserted at its next step that the running requests' adapters fit, and its engine died:
    found in the LoRA benchmark)."""
    s = _real_scheduler(max_loras=2)
    s.add_request(_real_request("stream", 20, adapter=2, priority=0))
    _step(s)
    s.add_request(_real_request("rag", 1500, adapter=1, priority=1))
    assert _step(s) == {"stream": 1, "rag": 128}  # a background step: the RAG prompt shares it
    s.add_request(_real_request("chat", 30, adapter=3, priority=0))
    steps = []
    for _ in range(10):
        steps.append(_step(s))
        adapters = {r.lora_request.lora_int_id for r in s.running}
        assert len(adapters) <= 2, (steps, adapters)
    first_chat = next(i for i, step in enumerate(steps) if "chat" in step)
    assert "stream" not in s.requests  # finished (8 tokens), and the chat went in after it
    assert all("rag" not in step for step in steps[:first_chat + 1])  # held while the chat waited and started
    assert any("rag" in step for step in steps[first_chat + 1:])
