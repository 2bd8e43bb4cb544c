"""A prefill and a decode worker on `sim` engines, running in the test's own event loop."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import redis.asyncio as aioredis

from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.core.streams import ensure_groups
from skyline.workers.decode import DecodeHandler
from skyline.workers.engines.sim import SimEngine, SimTiming
from skyline.workers.prefill import PrefillHandler
from skyline.workers.runtime import WorkerRuntime


async def start_fleet(redis_url: str, key_prefix: str, timing: SimTiming, suffix: str,
                      roles: tuple[str, ...] = ("prefill", "decode"), **worker_options):
    """(cfg, redis client, a runtime per role of `roles`, tasks); workers are named `<role>-<suffix>`
    (`<role>-<i>-<suffix>` for a role named more than once)."""
    cfg = SkylineConfig(key_prefix=key_prefix)
    # Short test prompts take the disaggregated path (the default prefills them on the decode worker).
    cfg = replace(cfg, redis=replace(cfg.redis, url=redis_url),
                  worker=replace(cfg.worker, heartbeat_s=0.2, **worker_options),
                  gateway=replace(cfg.gateway, min_remote_prefill_tokens=0))
    runtimes, tasks = [], []
    for i, role in enumerate(roles):
        name = f"{role}-{suffix}" if roles.count(role) == 1 else f"{role}-{i}-{suffix}"
        rcfg = replace(cfg, worker=replace(cfg.worker, role=role, worker_id=name))
        rt = WorkerRuntime(rcfg, SimEngine(timing), "skyline-sim")
        runtimes.append(rt)
        handlers = {"prefill": PrefillHandler(rt.port), "decode": DecodeHandler(rt.port)}
        tasks.append(asyncio.create_task(rt.run({s: handlers[s] for s in rt.stages}, install_signals=False)))
    client = aioredis.from_url(redis_url)
    await ensure_groups(client, Keys(key_prefix), cfg.tier_names)
    return cfg, client, runtimes, tasks


async def stop_fleet(client, runtimes, tasks, timeout_s: float = 20) -> None:
    for rt in runtimes:
        rt.stopping.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
    await client.aclose()


async def wait_registered(client, key_prefix: str, n: int = 2, timeout_s: float = 10) -> None:
    """Until `n` workers heartbeat (a gateway refuses requests for roles it has not seen yet)."""
    from skyline.core.fleet import list_workers

    for _ in range(int(timeout_s / 0.05)):
        if len(await list_workers(client, Keys(key_prefix), liveness_s=60)) >= n:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"fewer than {n} workers registered within {timeout_s} s")
