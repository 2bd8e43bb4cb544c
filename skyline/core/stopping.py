"""A process's way out, one bounded step at a time (the gateway's lifespan, a worker's stop)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

STOP_STEP_S = 5.0  # each awaited step of a way out; past it the step is abandoned


async def bounded_step(what: str, step: Awaitable, log: logging.Logger, limit_s: float = STOP_STEP_S) -> None:
    """Await `step` for at most `limit_s`; past that, go on without it, with a warning that names it and
    the stacks of the tasks still running (where it hung), so a hang that the process's stopper would
    otherwise end with a kill says where it was."""
    try:
        await asyncio.wait_for(step, limit_s)
    except TimeoutError:
        log.warning("stopping: %s did not end within %.0f s; going on without it. Tasks:\n%s", what, limit_s,
                    task_stacks())


def task_stacks() -> str:
    """Every other asyncio task of the running loop and where it waits (innermost frames last)."""
    me = asyncio.current_task()
    return "\n".join(f"{t.get_name()}: {t.get_coro()!r}\n" + "".join(
        f"  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}\n" for f in t.get_stack(limit=8))
        for t in asyncio.all_tasks() if t is not me)
