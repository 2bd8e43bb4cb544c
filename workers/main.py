"""Entry point of one worker process: build the engine, run the role's loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from skyline.core.config import EngineConfig, SkylineConfig
from skyline.core.net import listen_port
from skyline.workers.engines.base import Engine

log = logging.getLogger("skyline.worker")


def build_engine(ec: EngineConfig, model_path: str, urgent_priority: int = 0, role: str = "decode",
                 otlp_traces_endpoint: str = "") -> Engine:
    """The engine named in config; an unknown kind is an error, never a fallback.
    `urgent_priority`: the strictest tier's engine priority (its prompts get full steps);
    `otlp_traces_endpoint`: where a vLLM engine exports its own spans (the worker's, skyline/core/tracing.py)."""
    if ec.kind == "sim":
        from skyline.workers.engines.sim import SimEngine, SimTiming

        return SimEngine(SimTiming.of(ec), max_model_len=ec.max_model_len)
    if ec.kind == "vllm":
        from skyline.core import engine_args
        from skyline.workers.engines.vllm_engine import VllmEngine

        given: dict = {}
        if ec.vllm:  # the user's vLLM engine arguments, parsed and checked by vLLM (the CLI did it once already)
            ec, given = engine_args.resolve(ec, role)
        return VllmEngine(
            model=model_path, dtype=ec.dtype, max_model_len=ec.max_model_len, kv_cache_gib=ec.kv_cache_gib,
            gpu_memory_utilization=ec.gpu_memory_utilization,
            cpu_bind=ec.cpu_bind, nixl_host=ec.nixl_host, nixl_port=ec.nixl_port or listen_port(), kv_lease_s=ec.kv_lease_s,
            engine_nice=ec.engine_nice, kv_transfer=ec.kv_transfer, max_num_batched_tokens=ec.max_num_batched_tokens or None,
            block_size=ec.kv_block_size or None,
            long_prefill_token_threshold=ec.prefill_cap(), background_step_tokens=ec.background_tokens(role),
            hold_background_steps=ec.hold_background_steps, relaxed_step_tokens=ec.best_effort_step_tokens,
            urgent_priority=urgent_priority, cache_events=ec.prefix_cache_events, engine_args=given,
            otlp_traces_endpoint=otlp_traces_endpoint,
        )
    raise ValueError(f"unknown engine {ec.kind!r}: expected 'vllm' or 'sim'")


async def run_worker(cfg: SkylineConfig, model_path: str, model_name: str) -> None:
    from skyline.workers.decode import DecodeHandler
    from skyline.workers.endpoint import WorkerEndpoint
    from skyline.workers.prefill import PrefillHandler
    from skyline.workers.runtime import WorkerRuntime

    # Fix the side-channel port now: it is advertised in the heartbeat as well as in KV handles.
    moves_kv = cfg.engine.kind == "vllm" and cfg.engine.kv_transfer
    if moves_kv and not cfg.engine.nixl_port:
        from skyline.core import engine_args

        # Below the ephemeral range: the engine binds it only after loading the model (skyline/core/net.py).
        span = engine_args.ranks(cfg.engine, cfg.worker.role)
        cfg = replace(cfg, engine=replace(cfg.engine, nixl_port=listen_port(span)))
    engine = build_engine(cfg.engine, model_path, urgent_priority=min(t.priority for t in cfg.tiers),
                          role=cfg.worker.role, otlp_traces_endpoint=cfg.observability.otlp_traces_endpoint)
    rt = WorkerRuntime(cfg, engine, model_name, model_path)
    handlers = {"prefill": PrefillHandler, "decode": DecodeHandler}
    handler = {stage: handlers[stage](rt.port) for stage in rt.stages}
    # Up before the engine starts, so that orchestrators' liveness probes pass during start-up.
    endpoint = WorkerEndpoint(rt, cfg.worker.advertise_host or "127.0.0.1", cfg.worker.metrics_port)
    endpoint.registry.register(rt.metrics.registry)  # event metrics (workers/observe.py) next to the load gauges
    rt.info.address = endpoint.host
    rt.info.metrics_port = endpoint.start()
    rt.info.nixl_port = (cfg.engine.nixl_port or 0) if moves_kv else 0
    rt.on_start.append(endpoint.mark_ready)
    try:
        await rt.run(handler)
    finally:
        endpoint.stop()


def main(cfg: SkylineConfig, model_path: str, model_name: str) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run_worker(cfg, model_path, model_name))
