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

The heap is `heapq`'s in Python. Compiled (skyline/tools/simulate/native.py), the module uses its
own push and pop over the same entries: they compare the time and sequence number as machine
numbers, where `heapq` compares two tuples through Python's generic comparison. Keys are unique,
so both heaps pop the same events in the same order.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, Final, cast

# (time, sequence number, fn, arg). Typed loosely on purpose: mypyc keeps a tuple of declared item
# types unboxed, and would build a new tuple each time the heap moves an entry.
Entry = tuple[Any, ...]

COMPILED: Final = not __file__.endswith(".py")


def _push(heap: list[Entry], entry: Entry) -> None:
    """heapq.heappush for these entries (the compiled module's)."""
    heap.append(entry)
    _settle(heap, len(heap) - 1, entry)


def _pop(heap: list[Entry]) -> Entry:
    """heapq.heappop for these entries (the compiled module's): as heapq, the last entry goes down
    the path of smaller children to a leaf, then back up to its place (fewer comparisons)."""
    last = heap.pop()
    n = len(heap)
    if n == 0:
        return last
    top = heap[0]
    pos, child = 0, 1
    while child < n:
        right = child + 1
        if right < n:
            a, b = heap[child], heap[right]
            at: float = a[0]
            bt: float = b[0]
            if bt < at or (bt == at and cast(int, b[1]) < cast(int, a[1])):
                child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    _settle(heap, pos, last)
    return top


def _settle(heap: list[Entry], pos: int, entry: Entry) -> None:
    """Put `entry` at `pos` or above it, moving the larger entries on its way to the root down."""
    t: float = entry[0]
    seq: int = entry[1]
    while pos > 0:
        up = (pos - 1) >> 1
        parent = heap[up]
        pt: float = parent[0]
        if t < pt or (t == pt and seq < cast(int, parent[1])):
            heap[pos] = parent
            pos = up
        else:
            break
    heap[pos] = entry


class EventLoop:
    __slots__ = ("_heap", "_seq", "fired", "now")

    def __init__(self) -> None:
        self.now: float = 0.0
        self._heap: list[Entry] = []
        self._seq: int = 0
        self.fired: int = 0  # events run so far (arrivals included): the simulator's work measure

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run fn(arg) at virtual time t (never earlier than now)."""
        self._seq += 1
        entry = (t if t > self.now else self.now, self._seq, fn, arg)
        if COMPILED:
            _push(self._heap, entry)
        else:
            heapq.heappush(self._heap, entry)  # noqa: FURB136 - hot path

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self._seq += 1  # `at(now + delay)`, inlined: the most frequent way events are made
        t, now = self.now + delay, self.now
        entry = (t if t > now else now, self._seq, fn, arg)
        if COMPILED:
            _push(self._heap, entry)
        else:
            heapq.heappush(self._heap, entry)  # noqa: FURB136 - hot path

    def run(self, until: float, arrivals: Iterable[tuple[float, Any]] = (),
            on_arrival: Callable[[Any], None] | None = None) -> None:
        """Fire events and arrivals in time order up to `until` (inclusive); the clock ends at `until`."""
        heap = self._heap
        fired = 0
        for t_arrival, item in arrivals:
            if t_arrival > until:
                break
            # Events up to the arrival's time first (one at the same time was scheduled before it),
            # in a loop with nothing else to check: most events are not arrivals.
            while heap and heap[0][0] <= t_arrival:
                t, _seq, fn, arg = _pop(heap) if COMPILED else heapq.heappop(heap)
                self.now = t
                fn(arg)
                fired += 1
            self.now = t_arrival
            on_arrival(item)  # type: ignore[misc]
            fired += 1
        while heap and heap[0][0] <= until:
            t, _seq, fn, arg = _pop(heap) if COMPILED else heapq.heappop(heap)
            self.now = t
            fn(arg)
            fired += 1
        self.fired += fired
        self.now = max(self.now, until)

    def pending(self) -> int:
        return len(self._heap)
