"""Coalesce output frames from all of a worker's requests into one pipeline per loop turn.

A decode engine step produces one frame for every running sequence at once;
publishing them one awaited round trip at a time makes the worker's Redis
latency, not the engine, the limit on streamed tokens/s. Each frame is one
call of the fenced publish script (workers/runs.py: check ownership, log the
tokens, PUBLISH). Callers still get each call's own answer: the number of
subscribers that received the frame (0: the client has gone) or FENCED.

While Redis is down or restarting, a batch is retried (workers/outage.py) for
up to `grace_s`: the script applies a frame once by its number, so a batch
that partly ran before the connection broke is safe to send again, and the
request goes on where it was once Redis is back.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from skyline.workers.outage import RETRYABLE, ride_out


class BatchPublisher:
    def __init__(self, r: aioredis.Redis, script: AsyncScript, grace_s: float = 0.0):
        self.r = r
        self.script = script
        self.grace_s = grace_s  # how long a batch is retried while Redis is unreachable
        self._pending: list[tuple[list, list, asyncio.Future]] = []
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

    @property
    def in_order_batches(self) -> bool:
        """Do calls queued together reach Redis in order (one pipeline)? Not on a cluster (see `_run`)."""
        return not isinstance(self.r, RedisCluster)

    async def publish(self, keys: list, args: list) -> int:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((keys, args, fut))
        self._ready.set()
        return await fut

    async def publish_in_order(self, calls: list[tuple[list, list]]) -> list[int]:
        """Several frames of one request, run by Redis in this order: in one pipeline where
        batches keep their order, one after the other where they do not."""
        if not self.in_order_batches:
            return [await self.publish(keys, args) for keys, args in calls]
        return list(await asyncio.gather(*(self.publish(keys, args) for keys, args in calls)))

    async def _pipelined(self, batch: list[tuple[list, list, asyncio.Future]]) -> list:
        """One round trip of plain EVALSHAs. Not redis-py's Script-in-pipeline, which
        first asks SCRIPT EXISTS on every execute (a second round trip per batch). The
        script is loaded on demand: after a Redis restart the first batch answers
        NOSCRIPT, which means nothing ran, so loading and sending it again is safe."""
        for attempt in range(2):
            pipe = self.r.pipeline(transaction=False)
            for keys, args, _ in batch:
                pipe.evalsha(self.script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(x, NoScriptError) for x in results):
                self.script.sha = await self.r.script_load(self.script.script)
                continue
            return results
        return results

    async def _send(self, batch: list[tuple[list, list, asyncio.Future]]) -> list:
        """One attempt at the whole batch. A call that met a Redis going away or still loading
        its data (LOADING) raises, so that the batch is sent again."""
        if isinstance(self.r, RedisCluster):
            # redis-py refuses EVALSHA in cluster pipelines: one concurrent call per frame
            # (all of a request's keys share the {decode} slot, so they go to one node).
            results = await asyncio.gather(*(self.script(keys=keys, args=args) for keys, args, _ in batch),
                                           return_exceptions=True)
        else:
            results = await self._pipelined(batch)
        for x in results:
            if isinstance(x, RETRYABLE):
                raise x
        return results

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                results = await ride_out(lambda b=batch: self._send(b), self.grace_s, "publishing output frames")
            except Exception as exc:  # noqa: BLE001 - every waiting caller gets the failure
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, _, fut), receivers in zip(batch, results):
                if fut.done():
                    continue
                if isinstance(receivers, BaseException):
                    fut.set_exception(receivers)
                else:
                    fut.set_result(receivers)
