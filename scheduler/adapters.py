"""Adapter-aware placement: which engine to wait for when a request runs with a LoRA adapter.

An engine runs at most `max_loras` adapters at once (vLLM's slots) and keeps the adapters it loaded
until they are evicted (least recently used) or unloaded; loading one costs time (reading its weights,
moving them into a slot), and an engine whose slots are taken by adapters with running requests makes
a request for another adapter wait in its queue. So a request that names an adapter is best served by
an engine that already holds it, as a prompt is best served where its prefix is cached
(scheduler/prefix.py), and with the same bound on how long it waits for that engine:

- `choose`: among the live workers of the request's stage whose heartbeats say their engines hold the
  adapter and that are not full, the least loaded (the first on a tie); placed for it (its affinity
  lane) until `wait_bound_ms`: a share of the request's slack to its TTFT deadline, or what loading
  the adapter elsewhere costs (`load_ms`) where that is longer, never past the slack nor past
  `max_wait_ms`. Past that bound, or when no engine holds the adapter, any worker may claim it, and
  its engine loads the adapter (into a free slot, or evicting its least recently used one).
- `load_wait_ms`: what admission control adds to the request's predicted TTFT when no live engine
  of the stage holds the adapter: one load, as measured by the workers (their heartbeats' mean), or
  `default_load_ms` before any worker measured one.

With fewer than two workers of the stage there is nothing to choose (the shared queue reaches the
one engine anyway). Workers whose engines run no LoRA (`lora_slots` 0) are never placed for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from skyline.scheduler.elastic import serves
from skyline.scheduler.prefix import AffinityPolicy, Choice, overloaded, wait_bound_ms


@dataclass(frozen=True)
class AdapterPolicy:
    enabled: bool = True  # False: adapter-blind (any worker takes any request, as without this policy)
    slack_share: float = 0.5  # wait for a holder at most this share of the slack to the TTFT deadline
    max_wait_ms: int = 2_000  # and never longer than this
    default_load_ms: float = 200.0  # one adapter load, until a worker has measured one


class AdapterWorker(Protocol):
    """What placement reads of a worker's heartbeat (the live `WorkerInfo`, or a simulated worker's)."""

    worker_id: str
    role: str
    running: int
    max_running: int
    kv_usage: float
    kv_watermark: float
    lora_slots: int  # adapters its engine runs at once (0: no LoRA)
    adapter_load_ms: float  # its measured load time (0: not measured)

    def held_adapters(self) -> frozenset[str]: ...


class Candidate(NamedTuple):
    worker: str
    holds: bool  # its engine holds the adapter
    overloaded: bool
    load: float  # requests it holds (or this gateway placed for it and has not seen end)


def lora_workers(workers: Iterable[AdapterWorker], stage: str) -> list[AdapterWorker]:
    """The workers of `stage` whose engines run LoRA adapters."""
    return [w for w in workers if w.lora_slots > 0 and serves(w.role, stage)]


def candidates(adapter: str, workers: Sequence[AdapterWorker], placed: Mapping[str, int] | None = None) -> list[Candidate]:
    placed = placed or {}
    return [Candidate(w.worker_id, adapter in w.held_adapters(), overloaded(w),
                      float(max(w.running, placed.get(w.worker_id, 0)))) for w in workers]


def place(policy: AdapterPolicy, cands: Sequence[Candidate]) -> Candidate | None:
    """The worker to wait for: the least loaded holder not overloaded (the first on a tie); None: no
    such holder (the shared queue: the first worker with room claims it and loads the adapter)."""
    if not policy.enabled:
        return None
    holders = [c for c in cands if c.holds and not c.overloaded]
    return min(holders, key=lambda c: c.load, default=None)


def load_ms(policy: AdapterPolicy, workers: Iterable[AdapterWorker]) -> float:
    """What loading an adapter takes: the mean of the workers' measured loads, else the policy's default."""
    measured = [w.adapter_load_ms for w in workers if w.adapter_load_ms > 0]
    return sum(measured) / len(measured) if measured else policy.default_load_ms


def load_wait_ms(policy: AdapterPolicy, adapter: str | None, workers: Sequence[AdapterWorker]) -> float:
    """Time admission control adds to a request's predicted TTFT for its adapter: 0 without one or when
    an engine of the stage (`workers`, as `lora_workers` gives them) holds it, else one load."""
    if adapter is None or any(adapter in w.held_adapters() for w in workers):
        return 0.0
    return load_ms(policy, workers)


def choose(policy: AdapterPolicy, adapter: str | None, workers: Sequence[AdapterWorker], now_ms: int,
           deadline_ms: int, placed: Mapping[str, int] | None = None) -> Choice | None:
    """The worker of the stage (`workers`, as `lora_workers` gives them) to place a request with
    `adapter` for, and until when only it may claim it; None: the shared queue."""
    if adapter is None or not policy.enabled or len(workers) < 2:
        return None
    best = place(policy, candidates(adapter, workers, placed))
    if best is None:
        return None
    bound = AffinityPolicy(slack_share=policy.slack_share, max_wait_ms=policy.max_wait_ms)
    return Choice(best.worker, wait_bound_ms(bound, now_ms, deadline_ms, load_ms(policy, workers)), 0)
