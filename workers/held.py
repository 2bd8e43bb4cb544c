"""One record per request a worker holds, and the table of those records.

A request is held from its claim until its task has unwound: the stream entry
it came from, the request itself (unwrapped once from the decode work that may
carry it), its task, the phase it is in, and, once the worker has decided to end
it early, why. What the claim rule and preemption look at (how many requests are
held, their prompt tokens, which prompts the engine is computing) is read off
these records; the runtime (workers/runtime.py) owns every transition, and the
role's handler moves a record on only where its engine's work moves on (a prompt
computed, a first token out).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from skyline.core import messages
from skyline.core.stage_queues import stage_of_message
from skyline.core.streams import Claimed


class Fenced(Exception):
    """This worker's claim on a request was taken over; it must not publish or ack."""


class Phase(enum.IntEnum):
    """Where a held request is on this worker, in the order it gets there (as vLLM's RequestStatus)."""

    COMPUTING = 1  # its prompt is computed on this engine: it holds the step budget and may be preempted
    HANDING_OFF = 2  # prefill: the prompt is computed, the KV handle is being handed to a decode worker
    DECODING = 3  # decode: its KV is pulled or computed, its tokens stream to the client


class Exit(str, enum.Enum):
    """How a held request leaves the worker; the value names its counter (`WorkerRuntime.counters`)."""

    COMPLETED = "completed"  # the handler finished it (or handed it on)
    FAILED = "failed"  # ended with an error frame
    DROPPED_LATE = "dropped_late"  # queued past its deadline in a tier that drops late requests
    FENCED = "fenced"  # another worker took it over: that worker owns the entry now
    # Decided by the worker while the request runs; the strongest decision wins (`HeldRequest.end_early`).
    CANCELLED = "cancelled"  # its client left: acked, nothing left to deliver
    HANDED_BACK = "handed_back"  # the worker stops (drain): back on its stream for another worker
    PREEMPTED = "preempted"  # a more urgent request needs the step budget: requeued with its deadline


# A request cancelled for two reasons leaves for the stronger: a preempted request is requeued
# even when a drain or its client's cancel came first (a gone client's tombstone drops it later).
_STRENGTH = {Exit.CANCELLED: 1, Exit.HANDED_BACK: 2, Exit.PREEMPTED: 3}


@dataclass(eq=False)
class HeldRequest:
    claimed: Claimed
    request: messages.GenerateRequest
    phase: Phase
    task: asyncio.Task | None = None
    # Set when the worker decides to end the request early (`end_early`); its task's cancellation may
    # still be on its way (see `cancel_pending`).
    leaving: Exit | None = None
    cancel_delivered: bool = False  # the task's CancelledError reached the runtime's handler
    tombstone: asyncio.Task | None = None  # the check "did its client leave while it was queued?"
    # The role's work it gets: "prefill" (compute the prompt, hand its KV on) or "decode" (stream its
    # tokens, computing the prompt here if no KV comes with it). Its stage's, unless an elastic worker
    # serves a prompt from the prefill streams whole (scheduler/elastic.py).
    serve_as: str = ""
    decode_on: str | None = None  # serve_as "prefill": the peer its hand-off is placed for (None: any)
    decode_placed: str = ""  # why an elastic worker decodes it here or on `decode_on` (scheduler/elastic.py)
    claimed_s: float = 0.0  # when the worker took it (monotonic s): the claim defer estimates its progress from it
    # Called when its prompt stops taking this engine's step budget (its table's `freed`).
    on_freed: Callable[[], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.serve_as = self.serve_as or self.stage

    @classmethod
    def of(cls, claimed: Claimed, phase: Phase) -> HeldRequest:
        msg = claimed.message
        req = msg.request if isinstance(msg, messages.DecodeWork) else msg
        return cls(claimed, req, phase)  # type: ignore[arg-type]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def stage(self) -> str:
        """The stage whose streams it was claimed from (and goes back to, if it is requeued)."""
        return stage_of_message(self.claimed.message)

    @property
    def work(self) -> messages.Message:
        """The message as its handler serves it: a request from the prefill streams served whole
        here is decode work without a KV handle (its prompt computed here, as on the colocated route)."""
        msg = self.claimed.message
        if self.serve_as == "decode" and not isinstance(msg, messages.DecodeWork):
            return messages.DecodeWork(request=self.request, kv_handle=None)
        return msg

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def computing(self) -> bool:
        """Its prompt takes this engine's step budget and preempting it would free some."""
        return self.phase is Phase.COMPUTING and self.leaving is not Exit.PREEMPTED

    @property
    def returning_to_queue(self) -> bool:
        """Its entry goes back to the queue (preempted or handed back): another attempt serves it."""
        return self.leaving in (Exit.PREEMPTED, Exit.HANDED_BACK)

    @property
    def cancel_pending(self) -> bool:
        """The worker cancelled its task and the cancellation has not reached the runtime yet.

        Python 3.11's asyncio.wait_for, which redis-py awaits inside its commands, drops a
        cancellation that lands just as the awaited call completes (fixed in 3.12): the task runs on
        as if nothing happened (a cancelled decode keeps streaming). A handler's loop checks
        this at every step and raises CancelledError itself; cancelling the task again instead could
        land in the middle of its own clean-up (a requeue) and break it."""
        return self.leaving is not None and not self.cancel_delivered

    # -- transitions -----------------------------------------------------------

    def prompt_computed(self) -> None:
        """Prefill: the engine finished the prompt; aborting it now frees no step budget (its blocks
        wait for the decode worker), so it is no preemption victim any more."""
        if self.phase is Phase.COMPUTING:
            self.phase = Phase.HANDING_OFF
            self._freed()

    def first_token(self) -> None:
        """Decode: the first token is out; a prompt computed here no longer holds the step budget."""
        was = self.phase
        self.phase = Phase.DECODING
        if was is Phase.COMPUTING:
            self._freed()

    def _freed(self) -> None:
        if self.on_freed is not None:
            self.on_freed()

    def end_early(self, why: Exit) -> None:
        """The worker ends the request (`CANCELLED`, `HANDED_BACK`, `PREEMPTED`): cancel its task,
        remembering the strongest reason it was given."""
        if self.leaving is None or _STRENGTH[why] > _STRENGTH[self.leaving]:
            self.leaving = why
        if self.task is not None:
            self.task.cancel()

    async def tombstone_checked(self) -> None:
        """Wait for the answer to "did the client leave while it was queued?", asked when the request
        was claimed: if it did, this request's task is cancelled (at this await at the latest). A
        decode worker asks before its engine takes a handed-off prompt's handle: until then it can
        free the prefill engine's blocks itself, while an engine request aborted as it is being
        submitted may leave them to the lease."""
        if self.tombstone is not None:
            await asyncio.shield(self.tombstone)


class HeldTable:
    """The requests a worker holds, by id, with the prompt tokens they bring.

    A preempted or handed-back request can be claimed again, under the same id, before its old
    task has finished unwinding: the new record replaces the old one under the id, and the old one
    is released without touching it. Both count in `prompt_tokens` until each is released.

    `freed` is set whenever a prompt stops taking the engine's step budget (its first token, its prompt
    computed, or it leaves while computing): a claim loop waiting out its claim defer wakes on it
    (scheduler/claiming.py "Who claims first")."""

    def __init__(self) -> None:
        self._by_id: dict[str, HeldRequest] = {}
        self.prompt_tokens = 0
        self.freed = asyncio.Event()

    def add(self, held: HeldRequest) -> None:
        self._by_id[held.request_id] = held
        self.prompt_tokens += held.prompt_tokens
        held.on_freed = self.freed.set

    def release(self, held: HeldRequest) -> None:
        """Its task has ended (done, failed, cancelled, preempted, handed back): it is held no more."""
        if self._by_id.get(held.request_id) is held:
            del self._by_id[held.request_id]
        self.prompt_tokens -= held.prompt_tokens
        if held.phase is Phase.COMPUTING:
            self.freed.set()

    def get(self, request_id: str) -> HeldRequest | None:
        return self._by_id.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[HeldRequest]:
        return iter(list(self._by_id.values()))

    def ids(self) -> list[str]:
        return list(self._by_id)

    def phase_of(self, request_id: str) -> Phase | None:
        held = self._by_id.get(request_id)
        return held.phase if held is not None else None

    def computing(self) -> list[HeldRequest]:
        """The prompts this engine computes and a preemption may abort, in claim order."""
        return [h for h in self._by_id.values() if h.computing]

    def computing_prompts(self) -> list[HeldRequest]:
        """The prompts in their computing phase (preempted ones until they unwind), in claim order."""
        return [h for h in self._by_id.values() if h.phase is Phase.COMPUTING]

    def computing_tokens(self) -> int:
        """Prompt tokens of the prompts in their computing phase (preempted ones until they unwind):
        what a decode worker's own prompts take of its step budget (scheduler/claiming.py)."""
        return sum(h.prompt_tokens for h in self._by_id.values() if h.phase is Phase.COMPUTING)
