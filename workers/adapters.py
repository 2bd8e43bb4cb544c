"""A worker's side of the fleet's LoRA adapters (skyline/core/adapters.py).

At start the worker registers its `--lora-modules` (static adapters, as `vllm serve` serves them from
its start; a name the fleet already serves from another path is logged and left as it is). At every
heartbeat it reads the registry and removes from its engine the adapters that are no longer there
(unloaded through a gateway, or loaded again under a new id), then advertises what its engine holds,
its slots and its load time: what the gateway's adapter-aware placement reads (scheduler/adapters.py).
A request carries its adapter (name, id, path), so the engine can load any adapter the registry held
when the request was sent; a worker that joins later serves every registered adapter the same way.
A worker that runs LoRA also answers the gateways' checks of a path to load (`serve_checks`): its
engine reads it, since a gateway may run where the adapters are not.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from skyline.core import adapters
from skyline.core.fleet import WorkerInfo
from skyline.core.keys import Keys
from skyline.workers.engines.base import Engine

log = logging.getLogger("skyline.worker.adapters")


class AdapterKeeper:
    def __init__(self, engine: Engine, r: aioredis.Redis, keys: Keys, info: WorkerInfo):
        self.engine, self.redis, self.keys, self.info = engine, r, keys, info

    async def start(self) -> None:
        """Register the worker's static adapters (after the engine started: it knows whether it runs LoRA)."""
        modules = list(self.engine.static_adapters)
        if not modules:
            return
        registered = await adapters.register_static(self.redis, self.keys, modules, self.info.model)
        for problem in adapters.conflicts(modules, registered):
            log.error("%s", problem)
        log.info("LoRA adapters served from the start: %s", ", ".join(f"{a.name} (id {a.lora_id})" for a in registered))

    async def serve_checks(self) -> None:
        """Answer checks of adapter paths (skyline/core/adapters.py `ask_check`) for as long as the worker
        runs; a worker whose engine runs no LoRA takes none, so one that can load adapters answers."""
        if not self.engine.lora_slots:
            return
        while True:
            try:
                check = await adapters.take_check(self.redis, self.keys, 1.0)
                if check is None:
                    continue
                problem, missing = await self.engine.check_adapter(check.path)
                await adapters.answer_check(self.redis, check,
                                            adapters.CheckResult(self.info.worker_id, problem, missing))
            except (RedisError, OSError) as exc:  # Redis away: the heartbeat's own handling decides the rest
                log.debug("adapter checks not read: %s", exc)
                await asyncio.sleep(1.0)

    async def beat(self) -> None:
        """Drop what the fleet unloaded; advertise what the engine holds (before each heartbeat)."""
        engine, info = self.engine, self.info
        info.lora_slots = engine.lora_slots
        if not engine.lora_slots:
            return
        held = await engine.adapters()
        if held:
            live = {a.lora_id for a in (await adapters.read_all(self.redis, self.keys)).values()}
            for lora_id in [i for i in held if i not in live]:
                await engine.remove_adapter(lora_id)
                del held[lora_id]
        info.adapters = ",".join(sorted(held.values()))
        info.adapter_load_ms = round(engine.adapter_load_ms, 1)
        info.adapter_loads = engine.adapter_loads
