"""The sim engine's LoRA adapters, modelled as vLLM runs them: slots, loads, LRU, cache keys."""

from __future__ import annotations

import asyncio
import time

import pytest

from skyline.core.messages import AdapterRef, SamplingSpec
from skyline.workers.engines.base import EngineRequest, RequestRefused
from skyline.workers.engines.sim import SimEngine, SimTiming

FAST = dict(prefill_base_s=0.001, prefill_per_token_s=0.0, decode_base_s=0.005, decode_per_seq_s=0.0)


def req(rid: str, adapter: AdapterRef | None, max_tokens: int = 4, prompt: int = 40) -> EngineRequest:
    return EngineRequest(rid, list(range(1, prompt + 1)), SamplingSpec(max_tokens=max_tokens), adapter=adapter)


A, B, C = AdapterRef("a", 1, "/a"), AdapterRef("b", 2, "/b"), AdapterRef("c", 3, "/c")


async def run(engine: SimEngine, r: EngineRequest, done: dict) -> None:
    async for chunk in engine.generate(r, None):
        if chunk.done:
            done[r.request_id] = time.monotonic()


@pytest.mark.asyncio
async def test_one_slot_runs_one_adapter_at_a_time_and_a_load_costs_its_time():
    engine = SimEngine(SimTiming(**FAST, lora_slots=1, lora_load_s=0.2))
    await engine.start()
    try:
        done: dict[str, float] = {}
        t0 = time.monotonic()
        await asyncio.gather(run(engine, req("a1", A, max_tokens=20), done), run(engine, req("b1", B), done))
        # b waited for a's 20 tokens (its slot), then paid a load of its own: two loads in all.
        assert done["b1"] > done["a1"]
        assert engine.adapter_loads == 2 and done["b1"] - t0 >= 0.4
        assert await engine.adapters() == {2: "b"}  # one slot keeps one adapter: a was evicted
        assert engine.adapter_load_ms == pytest.approx(200.0)
        # b is held: no load this time.
        t1 = time.monotonic()
        await run(engine, req("b2", B), done)
        assert engine.adapter_loads == 2 and done["b2"] - t1 < 0.2
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_two_slots_run_two_adapters_together_and_keep_the_most_recent():
    engine = SimEngine(SimTiming(**FAST, lora_slots=2, lora_load_s=0.05))
    await engine.start()
    try:
        done: dict[str, float] = {}
        await asyncio.gather(run(engine, req("a1", A, max_tokens=30), done), run(engine, req("b1", B), done))
        assert done["b1"] < done["a1"]  # b did not wait for a: a slot each
        await run(engine, req("c1", C), done)
        assert await engine.adapters() == {2: "b", 3: "c"}  # a, least recently used, evicted
        await engine.remove_adapter(2)
        assert await engine.adapters() == {3: "c"}
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_blocks_computed_with_an_adapter_are_not_the_base_models():
    engine = SimEngine(SimTiming(**FAST, lora_slots=2, lora_load_s=0.0))
    await engine.start()
    try:
        async def cached(r: EngineRequest) -> int:
            last = None
            async for chunk in engine.generate(r, None):
                last = chunk
            return last.kv_transfer["num_cached_tokens"]

        assert await cached(req("base1", None)) == 0
        assert await cached(req("base2", None)) == 32  # two full blocks of 16 reused
        assert await cached(req("lora1", A)) == 0  # the same prompt with an adapter: nothing reused
        assert await cached(req("lora2", A)) == 32
        assert await cached(req("lora3", B)) == 0
    finally:
        await engine.shutdown()


@pytest.mark.asyncio
async def test_an_engine_without_lora_refuses_an_adapter():
    engine = SimEngine(SimTiming(**FAST, lora_slots=0))
    await engine.start()
    try:
        with pytest.raises(RequestRefused, match="LoRA adapter"):
            async for _ in engine.generate(req("x", A), None):
                pass
    finally:
        await engine.shutdown()
