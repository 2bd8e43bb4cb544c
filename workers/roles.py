"""What differs between a prefill and a decode worker, as one small object per role.

The runtime (workers/runtime.py) asks its role's rules instead of branching on the
role's name; the handlers (workers/prefill.py, workers/decode.py) do the role's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from skyline.core import messages
from skyline.core.streams import needs_prefill
from skyline.scheduler.claiming import ClaimRoom
from skyline.workers.held import HeldTable, Phase


@dataclass(frozen=True)
class RoleRules:
    name: str  # the worker's role, as in its id and heartbeat
    stage: str  # the stage whose tier streams it consumes
    # Wait for "did its client leave while it was queued?" before starting a request (prefill: what it
    # makes, KV blocks and a handle, outlives it), or ask beside the first steps (decode: all it makes
    # goes to the client, so a yes cancels it as a cancel message would; every request saves a round
    # trip before its first token).
    checks_tombstone_first: bool
    # Claim the entry and its request's run (fencing, output so far) in one round trip (workers/runs.py).
    claims_run_with_entry: bool
    # The claim rule's KV watermark applies (placement does not wait for a worker that would not claim).
    has_kv_watermark: bool

    def first_phase(self, msg: messages.Message) -> Phase:
        """The phase a claimed message starts in."""
        raise NotImplementedError

    def has_room(self, room: ClaimRoom, held: HeldTable, kv_usage: Callable[[], float],
                 pace_ok: Callable[[], bool]) -> bool:
        """May the worker claim one more request (scheduler/claiming.py)?"""
        raise NotImplementedError

    def running_tokens(self, held: HeldTable) -> int:
        """Prompt tokens its heartbeat reports as held in its engine (a prefill worker's backlog)."""
        return 0


class PrefillRules(RoleRules):
    def first_phase(self, msg: messages.Message) -> Phase:
        return Phase.COMPUTING

    def has_room(self, room, held, kv_usage, pace_ok) -> bool:
        return room.prefill(len(held), held.prompt_tokens)

    def running_tokens(self, held: HeldTable) -> int:
        return held.prompt_tokens


class DecodeRules(RoleRules):
    def first_phase(self, msg: messages.Message) -> Phase:
        # Decode work without a KV handle (colocated route, or a migration) has its prompt computed here.
        return Phase.COMPUTING if needs_prefill(msg) else Phase.DECODING

    def has_room(self, room, held, kv_usage, pace_ok) -> bool:
        return room.decode(len(held), held.computing_tokens(), kv_usage(), pace_ok())


PREFILL = PrefillRules("prefill", "prefill", checks_tombstone_first=True, claims_run_with_entry=False,
                       has_kv_watermark=False)
DECODE = DecodeRules("decode", "decode", checks_tombstone_first=False, claims_run_with_entry=True,
                     has_kv_watermark=True)
ROLES = {r.name: r for r in (PREFILL, DECODE)}


def rules_of(role: str) -> RoleRules:
    try:
        return ROLES[role]
    except KeyError:
        raise ValueError(f"unknown worker role {role!r}: expected prefill or decode") from None
