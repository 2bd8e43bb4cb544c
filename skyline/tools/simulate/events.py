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
next completion moved) ignores the callbacks it superseded.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any


class EventLoop:
    __slots__ = ("_heap", "_seq", "fired", "now")

    def __init__(self) -> None:
        self.now: float = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq: int = 0
        self.fired: int = 0  # events run so far (arrivals included): the simulator's work measure

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run fn(arg) at virtual time t (never earlier than now)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, arg))  # noqa: FURB136 - hot path

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._seq += 1  # `at(now + delay)`, inlined: the most frequent way events are made
        t, now = self.now + delay, self.now
        heapq.heappush(self._heap, (t if t > now else now, self._seq, fn, arg))  # noqa: FURB136 - hot path

    def run(self, until: float, arrivals: Iterable[tuple[float, Any]] = (),
            on_arrival: Callable[[Any], None] | None = None) -> None:
        """Fire events and arrivals in time order up to `until` (inclusive); the clock ends at `until`."""
        heap, pop = self._heap, heapq.heappop
        fired = 0
        for t_arrival, item in arrivals:
            if t_arrival > until:
                break
            # Events up to the arrival's time first (one at the same time was scheduled before it),
            # in a loop with nothing else to check: most events are not arrivals.
            while heap and heap[0][0] <= t_arrival:
                t, _seq, fn, arg = pop(heap)
                self.now = t
                fn(arg)
                fired += 1
            self.now = t_arrival
            on_arrival(item)  # type: ignore[misc]
            fired += 1
        while heap and heap[0][0] <= until:
            t, _seq, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            fired += 1
        self.fired += fired
        self.now = max(self.now, until)

    def pending(self) -> int:
        return len(self._heap)
