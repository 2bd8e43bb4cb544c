"""A worker whose engine is dead or stuck ends itself, so that live workers take its requests over.

While a worker heartbeats, the fleet counts it alive: its claimed entries stay with it, and it goes
on claiming. When its engine can compute nothing more (the engine core died; or it holds requests
and completes no step for `worker.engine_stall_s`, scheduler/stall.py), every one of those requests
would wait for the gateway's first-frame timeout and fail. Instead the worker says why in its log,
leaves the registry at once (the reapers of its stage then see it gone, workers/reaper.py: prefills
are computed again, decode streams resume where they were), kills its engine's processes (a stuck
engine would hang a clean shutdown) and exits with `EXIT_ENGINE_FAILED`, for its supervisor
(Kubernetes, compose, systemd) to start a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from skyline.core.fleet import deregister
from skyline.core.stopping import bounded_step
from skyline.scheduler.stall import StallWatch

log = logging.getLogger("skyline.worker")

WATCH_PERIOD_S = 1.0
EXIT_ENGINE_FAILED = 3  # the worker's exit status when it ended itself for its engine
GIVE_UP_STEP_S = 2.0  # each awaited step of the way out: Redis may be what is slow


async def watch_engine(rt: Any) -> None:
    """The worker's side task: check the engine every `WATCH_PERIOD_S`; end the process if it failed."""
    limit_s = rt.cfg.worker.engine_stall_s
    watch = StallWatch(WATCH_PERIOD_S)
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        why = rt.engine.failure()
        progress = rt.engine.progress()
        if why is None and progress is not None and limit_s > 0:
            held, steps = progress
            if watch.check(time.monotonic(), steps, held > 0) >= limit_s:
                why = (f"its engine has held {held} request(s) for {watch.stalled_s:.0f} s without completing "
                       f"a step (worker.engine_stall_s = {limit_s:g})")
        if why is not None:
            await give_up(rt, why)
            return


async def give_up(rt: Any, why: str) -> None:
    """Leave the fleet and exit: the requests this worker holds are taken over by live workers."""
    held = sorted(rt.held.ids())
    log.error("worker %s gives up: %s. It holds %d request(s) (%s); it leaves the registry, kills its engine "
              "and exits with status %d, and live workers of its stage take its requests over",
              rt.worker_id, why, len(held), ", ".join(held[:8]) + (" ..." if len(held) > 8 else ""),
              EXIT_ENGINE_FAILED)
    rt.stopping.set()  # claims nothing more meanwhile
    rt.left_fleet = True  # and its heartbeat does not put it back in the registry
    for rid in held:
        rt.timeline.emit(rid, "worker_gave_up", reason=why)
    try:
        await bounded_step("deregistering", deregister(rt.redis, rt.keys, rt.worker_id), log, GIVE_UP_STEP_S)
    except (RedisConnectionError, RedisTimeoutError):
        pass  # the heartbeat stops with the process: the reapers see it gone a few seconds later
    await bounded_step("the timeline's last writes", rt.timeline.flush(), log, GIVE_UP_STEP_S)
    rt.engine.kill()
    logging.shutdown()
    os._exit(EXIT_ENGINE_FAILED)
