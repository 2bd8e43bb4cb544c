"""The last resort of a worker's stop: a thread that ends the process if the stop never completes."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
import threading
import time

log = logging.getLogger("skyline.worker")


class StopWatchdog(threading.Thread):
    """Ends a worker whose stop has not completed in `limit_s`: logs every asyncio task's stack
    and every thread's (where it hung), then exits with status 1. A thread, so a blocked event
    loop cannot hold it up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit_s: float):
        super().__init__(name="stop-watchdog", daemon=True)
        self.loop, self.limit_s = loop, limit_s

    def run(self) -> None:
        time.sleep(self.limit_s)
        log.error("worker did not stop within %.0f s of the signal; exiting (stacks follow)", self.limit_s)
        try:
            self.loop.call_soon_threadsafe(print_task_stacks)
        except RuntimeError:
            pass  # the loop is closed: the thread stacks below say the rest
        time.sleep(1.0)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(1)


def print_task_stacks() -> None:
    # Each task's chain of awaits, outermost first: the last line is where it waits.
    for task in asyncio.all_tasks():
        print(f"task {task.get_name()}:", file=sys.stderr)
        coro = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=sys.stderr)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
