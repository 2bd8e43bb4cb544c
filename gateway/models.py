"""The models a gateway serves: one pool per base model, learned from the workers' heartbeats.

A pool is what serving one model takes: vLLM's serving objects built for that model (its config,
tokenizer and chat template: gateway/openai_api.py) over a FleetClient of its own, and a dispatcher
that queues its requests on that model's streams (skyline/core/keys.py: the default model's plain keys,
another model's named after it) and checks, places and admits them against that model's workers only
(gateway/fleetview.py `ModelView`).

The gateway's own model (`skyline gateway --model`) has a pool from the start. Any other model is
learned from Redis: a worker heartbeats its served name, the keyspace of its queues, the folder its
engine loaded and its context length (skyline/core/fleet.py), and the first refresh of the fleet view
that sees a new keyspace builds its pool (in a thread: rendering objects, no weights). So a gateway
started before any worker of a model serves it within a heartbeat of the worker's start, and one
restarted knows every live model before it takes its first request.

`pool_for(name)` maps the `model` a request names to the pool that serves it: a base model's served
name, or "" / None for the default. Names no pool knows are answered by vLLM's own unknown-model
error (404), from the gateway's own model's serving objects. LoRA adapters map to their base model's
pool here (`adapters`): an adapter is served by its base model's workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skyline.core.fleet import WorkerInfo
from skyline.gateway.fleetview import FleetView, ModelView

log = logging.getLogger("skyline.gateway.models")


@dataclass(frozen=True)
class ModelSpec:
    """A base model as the gateway renders it: its served name, where its config and tokenizer are
    ("" = the sim engine's byte tokenizer), its context length and its queues' keyspace."""

    name: str
    path: str
    max_model_len: int
    keyspace: str

    @staticmethod
    def of(worker: WorkerInfo, default_max_model_len: int) -> ModelSpec:
        """The model a worker's heartbeat advertises (a worker that predates the fields: the config's length)."""
        path = "" if worker.engine == "sim" else worker.model_path
        return ModelSpec(worker.model, path, worker.max_model_len or default_max_model_len, worker.keyspace)


@dataclass
class ModelPool:
    """One served base model: its spec, vLLM's serving objects (`front`, a gateway/openai_api.py
    Frontend), its dispatcher and the view of its workers."""

    spec: ModelSpec
    front: Any
    dispatcher: Any  # gateway/dispatch.py Dispatcher
    own: bool = False  # the gateway's own model: listed and served (503 without workers) from the start
    view: ModelView | None = None  # set once the fleet view exists (the dispatcher reads the same)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def live(self) -> bool:
        return self.view is not None and bool(self.view.workers)

    def watch(self, fleet: FleetView) -> None:
        """Read its workers from `fleet` from now on (the dispatcher too)."""
        self.view = self.dispatcher.fleet = fleet.view(self.dispatcher.keys)


class ModelRegistry:
    """Every pool of one gateway, by served name and by keyspace. `build(spec)` makes a pool (blocking:
    run in a thread); the registry learns new models from each refresh of `fleet`."""

    def __init__(self, own: ModelPool, build: Callable[[ModelSpec], ModelPool], default_max_model_len: int):
        self.own = own
        self.build = build
        self.default_max_model_len = default_max_model_len
        self.by_name: dict[str, ModelPool] = {own.name: own}
        self.by_keyspace: dict[str, ModelPool] = {own.spec.keyspace: own}
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> its base model's served name
        self.failed: dict[str, str] = {}  # served name -> why its pool could not be built
        self._building: dict[str, asyncio.Task] = {}  # keyspace -> the build in progress
        self.fleet: FleetView | None = None

    def attach(self, fleet: FleetView) -> None:
        """Learn models from every refresh of `fleet` from now on."""
        self.fleet = fleet
        self.own.watch(fleet)
        fleet.on_refresh.append(self._learn)

    # ---- what a request is served by -------------------------------------------------------

    def pool_for(self, requested: str | None) -> ModelPool | None:
        """The pool that serves a request naming `requested` as its `model` (None: no pool knows it).
        "" or None: the gateway's own model, as vLLM serves a request without `model` by its first."""
        if not requested:
            return self.own
        base = self.adapters.get(requested, requested)
        return self.by_name.get(base)

    async def find(self, requested: str | None) -> ModelPool | None:
        """`pool_for`, after one fresh look at the fleet when the name is not known yet (a worker of it
        may have started since the last refresh) and after its pool's build, if one is in progress."""
        pool = self.pool_for(requested)
        # At most one fresh read per 50 ms, however many requests name unknown models.
        if pool is None and self.fleet is not None and requested not in self.failed \
                and time.monotonic() - self.fleet.refreshed_at > 0.05:
            await self.fleet.refresh()
            pool = self.pool_for(requested)
        if pool is None:
            building = [t for ks, t in self._building.items()
                        if any(w.model == requested and w.keyspace == ks for w in self._workers())]
            if building:
                await asyncio.wait(building, timeout=60)
                pool = self.pool_for(requested)
        return pool

    def listed(self) -> list[ModelPool]:
        """The pools `/v1/models` lists: the gateway's own model, and every other with a live worker."""
        return [p for p in self.by_name.values() if p.own or p.live]

    # ---- learning models ------------------------------------------------------------------

    def _workers(self) -> list[WorkerInfo]:
        return self.fleet.workers if self.fleet is not None else []

    async def _learn(self) -> None:
        """Start building a pool for each keyspace a live worker reads that no pool serves (not awaited:
        a refresh on a request's path must not wait for another model's tokenizer)."""
        assert self.fleet is not None
        for keyspace, workers in self.fleet.keyspaces().items():
            if keyspace in self.by_keyspace or keyspace in self._building:
                continue
            spec = ModelSpec.of(workers[0], self.default_max_model_len)
            if spec.name in self.failed:
                continue
            if spec.name in self.by_name:
                log.warning("workers of model %r read the queues of keyspace %r, but the gateway serves %r on "
                            "keyspace %r: their configs name different default models (default_model); they "
                            "get none of its requests", spec.name, keyspace, spec.name,
                            self.by_name[spec.name].spec.keyspace)
                self.failed[spec.name] = "its workers disagree on its keyspace"
                continue
            task = asyncio.create_task(self._add(spec), name=f"model-{spec.name}")
            self._building[keyspace] = task

    async def learn_now(self) -> None:
        """Build every live model's pool before returning (a gateway's start: it knows them all at once)."""
        await self._learn()
        if self._building:
            await asyncio.wait(list(self._building.values()))

    async def _add(self, spec: ModelSpec) -> None:
        try:
            pool = await asyncio.to_thread(self.build, spec)
        except Exception as exc:  # noqa: BLE001 - a model this gateway cannot render is refused, not fatal
            log.error("cannot serve model %r (from %s, advertised by its workers): %s", spec.name,
                      spec.path or "the sim engine", exc)
            self.failed[spec.name] = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self._building.pop(spec.keyspace, None)
        assert self.fleet is not None
        pool.watch(self.fleet)
        self.by_name[spec.name] = pool
        self.by_keyspace[spec.keyspace] = pool
        log.info("serving model %r (max_model_len %d, queues %s) from its workers' heartbeats", spec.name,
                 spec.max_model_len, f"keyspace {spec.keyspace!r}" if spec.keyspace else "on the plain keys")

    async def close(self) -> None:
        """Stop the builds in progress (a gateway shutting down)."""
        for task in list(self._building.values()):
            task.cancel()
        await asyncio.gather(*self._building.values(), return_exceptions=True)
