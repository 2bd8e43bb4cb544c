"""The event engine: a virtual clock and a heap of timed callbacks.

Ordering is total and deterministic: events fire by time, and events at the
same time in the order they were scheduled (a sequence number breaks ties),
so a run depends only on its inputs and seeds, never on hash order or
floating-point accidents of insertion.

Arrivals do not go through the heap: they are already sorted, so `run`
merges them with the heap (an arrival at the same time as a scheduled event
fires after it). A simulated hour at 1,000 req/s would otherwise push 3.6 M
extra entries.

Events are never removed. A component that reschedules (a decode batch whose
next completion moved) bumps a version number and ignores stale callbacks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any


class EventLoop:
    __slots__ = ("_heap", "_seq", "fired", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.fired = 0  # events run so far (arrivals included): the simulator's work measure

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run fn(arg) at virtual time t (never earlier than now)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, arg))  # noqa: FURB136 - hot path

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + delay, fn, arg)

    def run(self, until: float, arrivals: Iterable[tuple[float, Any]] = (), on_arrival=None) -> None:
        """Fire events and arrivals in time order up to `until` (inclusive); the clock ends at `until`."""
        heap, pop = self._heap, heapq.heappop
        it = iter(arrivals)
        nxt = next(it, None)
        fired = 0
        while True:
            t_event = heap[0][0] if heap else None
            if nxt is not None and (t_event is None or nxt[0] < t_event) and nxt[0] <= until:
                self.now = nxt[0]
                on_arrival(nxt[1])
                nxt = next(it, None)
            elif t_event is not None and t_event <= until:
                t, _seq, fn, arg = pop(heap)
                self.now = t
                fn(arg)
            else:
                break
            fired += 1
        self.fired += fired
        self.now = max(self.now, until)

    def pending(self) -> int:
        return len(self._heap)
