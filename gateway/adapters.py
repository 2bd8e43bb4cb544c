"""The gateway's LoRA adapters: vLLM's own adapter handling, over the fleet's registry in Redis.

`vllm serve` keeps its adapters in its `OpenAIServingModels` (`lora_requests`: what `/v1/models` lists
with their parent, what a request's `model` resolves to, what its load and unload routes change). The
gateway keeps that object and its code; what changes is where the set lives (skyline/core/adapters.py):

- `POST /v1/load_lora_adapter` runs vLLM's `load_lora_adapter` (its checks and answers: both fields,
  a name that is a base model, `load_inplace`), whose engine call, `add_lora`, is the fleet's load
  here (`FleetAdapters.add`): some live worker must run LoRA, one of them must be able to load the
  adapter from the path (it reads it where the engines run: the gateway may be on another host and
  never reads it), and the adapter is registered in Redis under a new fleet-wide id. Engines load it when a request first runs
  with it (adapter-aware placement prefers those that hold it: scheduler/adapters.py).
- `POST /v1/unload_lora_adapter` runs vLLM's `unload_lora_adapter`, then removes the adapter from the
  registry; each worker drops it from its engine at its next heartbeat.
- Every gateway copies the registry into its `lora_requests` (`sync`: each second, and before each
  load, unload and model list), so all gateways serve the same adapters, a restarted one at once.

Both routes are operators' (an operator key, when API keys are on), as `vllm serve` leaves them to
whoever runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline.core import adapters
from skyline.core.keys import Keys
from skyline.core.messages import GenerateRequest
from skyline.core.streams import Placement, now_ms
from skyline.gateway.errors import ApiError
from skyline.gateway.tenants import Tenants
from skyline.scheduler.adapters import AdapterPolicy, choose, load_wait_ms, lora_workers
from skyline.scheduler.prefix import PlacedInFlight

log = logging.getLogger("skyline.gateway")

SYNC_S = 1.0  # how often a gateway reads the registry (a load elsewhere is served here within this)
CHECK_WAIT_S = 10.0  # how long a load waits for a worker to check the adapter's path


class FleetAdapters:
    """The registry as this gateway serves it: each model pool's vLLM `models` (OpenAIServingModels)
    kept in step with Redis, and the pools' map of adapter -> base model (gateway/models.py)."""

    def __init__(self, keys: Keys, pools: Any, redis: Callable[[], Any]):
        self.keys, self.pools = keys, pools  # pools: gateway/models.py ModelRegistry
        self._redis = redis
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def lora_workers(self, base_model: str) -> list:
        fleet = self.pools.fleet
        return [w for w in (fleet.workers if fleet is not None else []) if w.model == base_model and w.lora_slots > 0]

    # -- vLLM's engine-client call -------------------------------------------------------------

    async def add(self, lora_request: Any) -> bool:
        """`EngineClient.add_lora` for the fleet: check, then register under a new fleet-wide id (set on
        `lora_request`, which vLLM's serving models then keep)."""
        from vllm.exceptions import LoRAAdapterNotFoundError

        path = lora_request.lora_path
        base = lora_request.base_model_name or self.pools.own.name
        # Read where the engines run, not here (skyline/core/adapters.py): a worker of the model checks it.
        keyspace = self.pools.by_name.get(base, self.pools.own).spec.keyspace
        checked = await adapters.ask_check(self._r(), self.keys.for_model(keyspace), path, CHECK_WAIT_S)
        if checked is None:  # vLLM answers an exception here with a 500 and its message
            raise RuntimeError(f"no worker of {base!r} that runs LoRA answered the check of {path} within "
                               f"{CHECK_WAIT_S:.0f} s")
        if checked.missing:  # vLLM's own answer (404) for an adapter its engine cannot find
            raise LoRAAdapterNotFoundError(lora_request.lora_name, path)
        if checked.problem:
            raise ValueError(f"worker {checked.worker} cannot load the LoRA adapter: {checked.problem}")
        registered = await adapters.register(self._r(), self.keys, lora_request.lora_name, path, base)
        lora_request.lora_int_id = registered.lora_id
        self.pools.adapters[registered.name] = base
        log.info("LoRA adapter %s loaded for the fleet from %s (id %d)", registered.name, path, registered.lora_id)
        return True

    # -- the registry -> vLLM's serving models --------------------------------------------------

    async def sync(self) -> None:
        """Make each pool's `models.lora_requests` what the registry holds for its model."""
        from vllm.lora.request import LoRARequest

        async with self._lock:
            registry = await adapters.read_all(self._r(), self.keys)
            own = self.pools.own.name
            self.pools.adapters.clear()
            self.pools.adapters.update({n: a.base_model or own for n, a in registry.items()})
            for pool in list(self.pools.by_name.values()):
                mine = {n: a for n, a in registry.items() if (a.base_model or own) == pool.name}
                held = pool.front.models.lora_requests
                for name in [n for n in held if n not in mine]:
                    del held[name]
                for name, a in mine.items():
                    have = held.get(name)
                    if have is None or have.lora_int_id != a.lora_id or have.lora_path != a.path:
                        held[name] = LoRARequest(lora_name=a.name, lora_int_id=a.lora_id, lora_path=a.path,
                                                 base_model_name=pool.name)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="adapter-sync")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except (RedisError, OSError) as exc:
                log.debug("adapter registry not read: %s", exc)
            await asyncio.sleep(SYNC_S)

    def _r(self) -> Any:
        r = self._redis()
        if r is None:
            raise ApiError(503, "the gateway is starting or stopping", code="not_ready")
        return r

    # -- routes ----------------------------------------------------------------------------------

    def add_routes(self, app: FastAPI, tenants: Tenants) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        def answer(result: Any) -> Response:
            if isinstance(result, ErrorResponse):
                return JSONResponse(result.model_dump(), status_code=result.error.code)
            return Response(status_code=200, content=result)  # vLLM's plain-text "Success: ..."

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            raw = await _operator_body(request, tenants)
            base = raw.pop("base_model_name", None) if isinstance(raw, dict) else None  # Skyline's field: below
            body = _validate(LoadLoRAAdapterRequest, raw)
            pool = await self._base_pool(base)
            await self._synced()
            return answer(await pool.front.models.load_lora_adapter(body, base_model_name=pool.name))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            body = _validate(UnloadLoRAAdapterRequest, await _operator_body(request, tenants))
            await self._synced()
            pool = self.pools.pool_for(body.lora_name) if body.lora_name in self.pools.adapters else self.pools.own
            result = await pool.front.models.unload_lora_adapter(body)
            if not isinstance(result, ErrorResponse):
                await adapters.unregister(self._r(), self.keys, body.lora_name)
                log.info("LoRA adapter %s unloaded from the fleet", body.lora_name)
            return answer(result)

    async def _base_pool(self, base: Any) -> Any:
        """The model an adapter loaded at run time adapts. vLLM's request names none (`vllm serve` serves one
        model); here the body may name it as `base_model_name` (vLLM's own name for an adapter's parent, in
        its LoRARequest and its load_lora_adapter); without it, the only model whose live workers run LoRA.
        Several such models and no name: 400 naming them (an adapter is trained for one base model)."""
        if base is not None:
            pool = await self.pools.find(base) if isinstance(base, str) and base else None
            if pool is None or pool.name != base:  # an adapter's name is no base model
                raise ApiError(404, f"base_model_name {base!r}: no model of that name is served here",
                               type="NotFoundError", param="base_model_name", code="model_not_found")
            if not self.lora_workers(pool.name):
                raise ApiError(400, f"no live worker of {pool.name!r} runs LoRA: start its workers with --enable-lora "
                                    "(vLLM's engine argument) to serve adapters", type="BadRequestError",
                               code="lora_not_enabled")
            return pool
        running = [p for p in self.pools.listed() if self.lora_workers(p.name)]
        if not running:
            own = self.pools.own.name
            raise ApiError(400, f"no live worker of {own!r} (or of any model) runs LoRA: start its workers with "
                                "--enable-lora (vLLM's engine argument) to serve adapters", type="BadRequestError",
                           code="lora_not_enabled")
        if len(running) > 1:
            raise ApiError(400, f"the workers of several models run LoRA ({', '.join(repr(p.name) for p in running)}): "
                                "name the adapter's base model as base_model_name", type="BadRequestError",
                           param="base_model_name", code="base_model_required")
        return running[0]

    async def _synced(self) -> None:
        try:
            await self.sync()
        except (RedisError, OSError) as exc:
            raise ApiError(503, f"the gateway cannot reach Redis ({exc})", code="redis_unavailable") from None


async def _operator_body(request: Request, tenants: Tenants) -> Any:
    tenant = tenants.authenticate(request)
    if not tenant.sees_all:
        raise ApiError(403, "loading and unloading LoRA adapters takes an operator key", type="PermissionError",
                       code="operator_only")
    try:
        return await request.json()
    except ValueError:
        raise ApiError(400, "the body is not JSON", type="BadRequestError") from None


def _validate(model: type, body: Any) -> Any:
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc.errors()[0].get('msg')} ({exc.errors()[0].get('loc')})",
                       type="BadRequestError") from None


# -- placement and admission (gateway/dispatch.py) ------------------------------------------------


def adapter_policy(g: Any) -> AdapterPolicy:
    """The adapter-affinity policy of a [gateway] config: prefix affinity's bound on the wait."""
    return AdapterPolicy(g.adapter_affinity, g.affinity_slack_share, g.affinity_max_wait_ms, g.adapter_load_ms)


def placement(policy: AdapterPolicy, workers: list, stage: str, req: GenerateRequest,
              in_flight: PlacedInFlight | None = None) -> Placement | None:
    """The worker of `stage` whose engine holds the request's adapter, to wait for (scheduler/adapters.py
    `choose`, on this machine's clock); None: the shared queue. Counted in `in_flight` when placed."""
    if req.adapter is None:
        return None
    c = choose(policy, req.adapter.name, lora_workers(workers, stage), now_ms(), req.deadline_ms,
               in_flight.count if in_flight else None)
    if c is None:
        return None
    if in_flight is not None:
        in_flight.add(req.request_id, c.worker)
    return Placement(c.worker, c.until_ms, 0)


def load_wait(policy: AdapterPolicy, workers: list, stage: str, req: GenerateRequest) -> float:
    """What admission adds to the request's predicted TTFT for loading its adapter (ms)."""
    if req.adapter is None or not policy.enabled:
        return 0.0
    return load_wait_ms(policy, req.adapter.name, lora_workers(workers, stage))
