"""Best-effort Redis writes, coalesced into one pipeline per event-loop turn.

Observability data (timeline events, SLO counters) is written from the hot
path of every request. Awaiting a round trip per event would add latency to
the request; dropping the write on a Redis error must never fail it. So
callers `add()` a function that queues commands on a pipeline; a background
flush sends everything added within `FLUSH_DELAY_S` in one round trip. The
short delay keeps the send off the moment a request moves on (a flush in the
same loop turn delays the request, its first token included) and lets one
flush carry the events of many requests.
`flush()` waits for what was added so far (tests, shutdown). Errors are
logged (at most once per `LOG_EVERY_S`) and counted: `errors` (failed
flushes) and `dropped` (writes lost; an op may count several).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

log = logging.getLogger("skyline.batchwrite")

LOG_EVERY_S = 30.0  # a dead Redis must not turn every event into a log line
FLUSH_DELAY_S = 0.005

# Queues commands on a (non-transactional) pipeline; returns how many writes it carries (None: one).
Op = Callable[[Any], "int | None"]


class PipelineBatcher:
    def __init__(self, r: Any, name: str):
        self.r = r
        self.name = name
        self.errors = 0  # failed flushes (each may have carried many writes)
        self.dropped = 0  # writes lost to those failures
        self._pending: list[Op] = []
        self._task: asyncio.Task | None = None
        self._last_log = 0.0

    def add(self, op: Op) -> None:
        """Queue `op` for the next flush. Never raises; needs a running event loop."""
        self._pending.append(op)
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._flush_soon(), name=f"{self.name}-flush")
            except RuntimeError:  # no running loop: nothing could ever send it
                self._pending.clear()
                self._failed(1, RuntimeError("no running event loop"))

    async def flush(self) -> None:
        """Wait until everything added so far was sent (or failed)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_DELAY_S)  # gather what else happens meanwhile
        while self._pending:
            batch, self._pending = self._pending, []
            pipe = self.r.pipeline(transaction=False)
            carried = 0
            try:
                for op in batch:
                    n = op(pipe)
                    carried += n if isinstance(n, int) and n > 0 else 1
                await pipe.execute()
            except (RedisError, OSError, ValueError, TypeError) as exc:
                self._failed(carried or len(batch), exc)

    def _failed(self, n: int, exc: BaseException) -> None:
        self.errors += 1
        self.dropped += n
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning("%s: %d write(s) dropped (%s: %s); requests are not affected (%d dropped so far)",
                        self.name, n, type(exc).__name__, exc, self.dropped)
