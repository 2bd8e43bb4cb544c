"""The gateway's cached view of which worker roles are alive, fleet-wide and per model.

Reading heartbeats from Redis on every request would add a round trip to the
hot path, so a background task refreshes the view every ~0.5 s. A request
that finds a role missing forces one fresh read before giving up, so a worker
that started a moment ago is not refused for up to one refresh period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from skyline.core.fleet import WorkerInfo, list_workers
from skyline.core.keys import Keys
from skyline.core.streams import queued_tokens
from skyline.scheduler.elastic import STAGES_OF_ROLE

log = logging.getLogger("skyline.gateway.fleet")

# The command an operator runs to bring up a worker of each stage (used in 503 messages).
START_HINT = {
    "prefill": "skyline worker prefill` or `skyline worker elastic",
    "decode": "skyline worker decode` or `skyline worker elastic",
}


class ModelView:
    """The part of the fleet that serves one model: the live workers on its queues' keyspace, and its
    prefill backlog, as of the fleet view's last refresh. What a model's dispatcher reads (the same
    attributes as the whole view's)."""

    def __init__(self, parent: FleetView, keys: Keys):
        self.parent = parent
        self.keys = keys  # its queues' keys (keyspace keys.model)
        self.workers: list[WorkerInfo] = []
        self.roles: Counter[str] = Counter()
        self.stages: Counter[str] = Counter()
        self.prefill_backlog_tokens = 0
        self.ever_served = False  # a worker of it was seen (its last one leaving means 503, not 404)

    @property
    def keyspace(self) -> str:
        return self.keys.model

    @property
    def error(self) -> str | None:
        return self.parent.error

    @property
    def refreshed_at(self) -> float:
        return self.parent.refreshed_at

    def see(self, workers: list[WorkerInfo], backlog_tokens: int) -> None:
        self.workers = [w for w in workers if w.keyspace == self.keyspace]
        self.roles = Counter(w.role for w in self.workers)
        self.stages = Counter(s for w in self.workers for s in STAGES_OF_ROLE.get(w.role, ()))
        self.prefill_backlog_tokens = backlog_tokens
        self.ever_served = self.ever_served or bool(self.workers)

    async def missing(self, needed: tuple[str, ...]) -> list[str]:
        """Stages in `needed` with no live worker of this model (after one fresh read if the cache says so)."""
        absent = [stage for stage in needed if not self.stages.get(stage)]
        if absent and time.monotonic() - self.refreshed_at > 0.05:
            await self.parent.refresh()
            absent = [stage for stage in needed if not self.stages.get(stage)]
        return absent


class FleetView:
    """Every live worker (`workers`, `roles`, `stages`: the whole fleet, of every model), and one
    `ModelView` per model the gateway serves (`view(keyspace)`), all refreshed together."""

    def __init__(self, r: aioredis.Redis, keys: Keys, liveness_s: float, refresh_s: float = 0.5):
        self.r = r
        self.keys = keys
        self.liveness_s = liveness_s
        self.refresh_s = refresh_s
        self.workers: list[WorkerInfo] = []
        self.roles: Counter[str] = Counter()  # live workers by role
        self.stages: Counter[str] = Counter()  # live workers by the stage they consume (elastic: both)
        self.error: str | None = None  # last refresh failure (Redis down), None when healthy
        self.prefill_backlog_tokens = 0  # prompt tokens admitted to the prefill pool and not yet prefilled
        self.refreshed_at = 0.0
        self._task: asyncio.Task | None = None
        self.models: dict[str, ModelView] = {}  # keyspace -> the view of that model's workers
        self.on_refresh: list[Callable[[], Awaitable[None]]] = []  # after each good refresh (the model registry)

    def view(self, keys: Keys) -> ModelView:
        """The view of the model whose queues are `keys` (made on first use, refreshed from then on)."""
        if keys.model not in self.models:
            self.models[keys.model] = ModelView(self, keys)
            self.models[keys.model].see(self.workers, 0)
        return self.models[keys.model]

    def keyspaces(self) -> dict[str, list[WorkerInfo]]:
        """The live workers by the keyspace of the queues they read (one per model)."""
        out: dict[str, list[WorkerInfo]] = {}
        for w in self.workers:
            out.setdefault(w.keyspace, []).append(w)
        return out

    async def refresh(self) -> None:
        try:
            workers = await list_workers(self.r, self.keys, self.liveness_s)
            views = list(self.models.values())
            backlogs = [sum((await queued_tokens(self.r, v.keys, "prefill")).values()) for v in views]
            self.prefill_backlog_tokens = sum((await queued_tokens(self.r, self.keys, "prefill")).values()) \
                if self.keys.model not in self.models else backlogs[views.index(self.models[self.keys.model])]
        except (RedisError, OSError) as exc:
            if self.error is None:
                log.warning("cannot read worker heartbeats: %s", exc)
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.workers = workers
        self.roles = Counter(w.role for w in workers)
        self.stages = Counter(s for w in workers for s in STAGES_OF_ROLE.get(w.role, ()))
        for view, backlog in zip(views, backlogs):
            view.see(workers, backlog)
        self.error = None
        self.refreshed_at = time.monotonic()
        for hook in self.on_refresh:
            await hook()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="fleet-view")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def missing(self, needed: tuple[str, ...]) -> list[str]:
        """Stages in `needed` with no live worker (after one fresh read if the cache says so)."""
        absent = [stage for stage in needed if not self.stages.get(stage)]
        if absent and time.monotonic() - self.refreshed_at > 0.05:
            await self.refresh()
            absent = [stage for stage in needed if not self.stages.get(stage)]
        return absent
