"""Coalesce PUBLISH commands from all of a worker's requests into one pipeline per loop turn.

A decode engine step produces one frame for every running sequence at once;
publishing them one awaited round trip at a time makes the worker's Redis
latency, not the engine, the limit on streamed tokens/s. Callers still get
each PUBLISH's own answer (the number of subscribers that received it),
which is how a worker notices that a client has gone.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis


class BatchPublisher:
    def __init__(self, r: aioredis.Redis):
        self.r = r
        self._pending: list[tuple[str, bytes, asyncio.Future]] = []
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-publisher")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for _, _, fut in self._pending:
            if not fut.done():
                fut.set_exception(ConnectionError("publisher closed"))

    async def publish(self, channel: str, payload: bytes) -> int:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((channel, payload, fut))
        self._ready.set()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            pipe = self.r.pipeline(transaction=False)
            for channel, payload, _ in batch:
                pipe.publish(channel, payload)
            try:
                results = await pipe.execute()
            except Exception as exc:  # noqa: BLE001 - every waiting caller gets the failure
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, _, fut), receivers in zip(batch, results):
                if not fut.done():
                    fut.set_result(receivers)
