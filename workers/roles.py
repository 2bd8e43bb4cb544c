"""What differs between the worker roles (prefill, decode, elastic), as one small object per role.

The runtime (workers/runtime.py) asks its role's rules instead of branching on the
role's name; the handlers (workers/prefill.py, workers/decode.py) do each stage's
work. An elastic worker consumes both stages (scheduler/elastic.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from skyline.core import messages
from skyline.core.streams import needs_prefill
from skyline.scheduler.claiming import ClaimRoom
from skyline.scheduler.elastic import STAGES_OF_ROLE
from skyline.workers.held import HeldTable, Phase


@dataclass(frozen=True)
class RoleRules:
    name: str  # the worker's role, as in its id and heartbeat
    # The claim rule's KV watermark applies (placement does not wait for a worker that would not claim).
    has_kv_watermark: bool

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages whose tier streams it consumes (scheduler/elastic.py)."""
        return STAGES_OF_ROLE[self.name]

    def first_phase(self, msg: messages.Message) -> Phase:
        """The phase a claimed message starts in: anything without a KV handle has its prompt computed here."""
        return Phase.COMPUTING if needs_prefill(msg) else Phase.DECODING

    def has_room(self, room: ClaimRoom, held: HeldTable, kv_usage: Callable[[], float],
                 pace_ok: Callable[[], bool]) -> bool:
        """May the worker claim one more request (scheduler/claiming.py)? An engine that runs streams
        (decode, elastic) keeps to the decode rule: its prompts share the step budget with them."""
        return room.decode(len(held), held.computing_tokens(), kv_usage(), pace_ok())

    def running_tokens(self, held: HeldTable) -> int:
        """Prompt tokens its heartbeat reports as held in its engine (`skyline status`)."""
        return held.computing_tokens()


class PrefillRules(RoleRules):
    def has_room(self, room, held, kv_usage, pace_ok) -> bool:
        return room.prefill(len(held), held.prompt_tokens)

    def running_tokens(self, held: HeldTable) -> int:
        return held.prompt_tokens


PREFILL = PrefillRules("prefill", has_kv_watermark=False)
DECODE = RoleRules("decode", has_kv_watermark=True)
ELASTIC = RoleRules("elastic", has_kv_watermark=True)
ROLES = {r.name: r for r in (PREFILL, DECODE, ELASTIC)}


def rules_of(role: str) -> RoleRules:
    try:
        return ROLES[role]
    except KeyError:
        raise ValueError(f"unknown worker role {role!r}: expected {', '.join(ROLES)}") from None
