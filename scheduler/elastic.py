"""Elastic workers: one engine takes either phase, and where a prompt's decode runs is decided per request.

A worker's role says which stages it consumes: a `prefill` worker the prefill
streams, a `decode` worker the decode streams, an `elastic` worker both, in one
earliest-deadline-first order over their heads. So no engine idles while work
it could start waits in either stage.

An elastic worker that claims a prompt from the prefill streams (a prompt long
enough to be worth moving: scheduler/disagg.py) computes it, then decodes it
either itself or on a peer (`decoder_for`). It hands the decode on when a peer
with room decodes fewer streams than it does, or as many while prompts are
queued for the fleet: this engine is then better used on the next prompt, and
the streams stay where no long prompt interrupts them. Otherwise the request
stays: no KV moves, nothing waits for a hand-off. The hand-off is placed for that
peer (its affinity lane, scheduler/prefix.py), so the engine that computed the
prompt does not claim it back; past `HANDOFF_HOLD_MS` any worker may.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Mapping
from typing import Protocol

STAGES_OF_ROLE = {"prefill": ("prefill",), "decode": ("decode",), "elastic": ("decode", "prefill")}
ROLES = tuple(STAGES_OF_ROLE)
# Of two stages' heads due at the same time, the first stage's is claimed first: a stream already started
# finishes before a new prompt begins.
STAGE_ORDER = STAGES_OF_ROLE["elastic"]

# How long a hand-off placed for a peer waits for it before any worker of the stage may claim it (the
# peer had room when it was chosen: it claims within a loop turn unless it died or filled up).
HANDOFF_HOLD_MS = 1_000


def serves(role: str, stage: str) -> bool:
    """Does a worker of `role` consume `stage`'s streams?"""
    return stage in STAGES_OF_ROLE.get(role, ())


class PeerLoad(Protocol):
    """What a peer's heartbeat says (the live `WorkerInfo`, or a simulated worker's)."""

    worker_id: str
    role: str
    running: int
    max_running: int
    kv_usage: float
    kv_watermark: float  # 0: it claims at any KV usage
    running_tokens: int  # tokens of the prompts its engine is computing


def stage_due_first(due_ms: Mapping[str, int]) -> str | None:
    """The stage an elastic worker claims from next, of `due_ms` (stage -> the deadline of the head it
    may claim there; a stage with none left out): earliest deadline first, `STAGE_ORDER` among equals.
    The live worker (skyline/core/stage_queues.py) and the simulated one (skyline/tools/simulate) ask it."""
    best: str | None = None
    for stage in STAGE_ORDER:
        due = due_ms.get(stage)
        if due is not None and (best is None or due < due_ms[best]):
            best = stage
    return best


def has_room(peer: PeerLoad, prompt_budget: int, step_tokens: int = 0) -> bool:
    """Would the peer take one more decode now (its claim rule: the count, the prompt tokens it computes
    against `prompt_budget`, the KV watermark), and start it in its next step? A peer computing a full
    budget of prompts would leave the hand-off waiting, and the engine that computed it would end up
    taking it back. A peer whose own prompts fill a step (`step_tokens`, the engines' step budget; 0 =
    unknown) claims the hand-off but starts it only once they are done: vLLM schedules the prompts it
    runs before a waiting request, so the KV pull waits behind them (measured on the one-core elastic
    fleet, 1024-token prompts: a 47 MB pull took 6.8 s)."""
    if peer.max_running and peer.running >= peer.max_running:
        return False
    if prompt_budget and peer.running_tokens >= prompt_budget:
        return False
    if step_tokens and peer.running_tokens >= step_tokens:
        return False
    return not (peer.kv_watermark and peer.kv_usage >= peer.kv_watermark)


def decoder_for(me: str, my_streams: int, peers: Iterable[PeerLoad], prompts_queued: bool,
                prompt_budget: int = 0, spread: str | None = None, step_tokens: int = 0,
                prompt_tokens: int = 0, min_move_tokens: int = 0) -> tuple[str | None, str]:
    """Where an elastic worker `me`, decoding `my_streams` requests, decodes a prompt it computes, and
    why: (None, why) = itself, else (the peer that should: fewest streams, then fewest prompt tokens
    computing, the first of equals, why). `prompt_budget`: the claim rule's prompt-token budget;
    `step_tokens`: the engines' step budget (`has_room`). A prompt of fewer than `min_move_tokens`
    tokens (`[gateway] min_remote_prefill_tokens`: its KV move costs more than it saves) is decoded
    where it was computed: the peer starts a pulled request only some steps after it claims it (pull,
    then a step of its own; measured on the one-core elastic fleet: ~1 s for a 158-token chat, the
    slowest first tokens of the run), while this engine decodes it at its next step.

    `spread` (the request's id): the peer is the better of two drawn, by that key, from those with
    room, not the best of all. Every worker reads its peers from heartbeats up to a beat old, so the
    best of all is the same few peers for every worker until their next beats, and on a large fleet
    those few were sent more hand-offs than they could claim (simulated, 512 engines: 4,122 of 5,120
    hand-offs went to 21 peers). Two random choices spread them while still favouring the less loaded;
    a fleet of two or three engines has at most two peers to choose from and is unchanged."""
    if prompt_tokens and prompt_tokens < min_move_tokens:
        return None, "too_short_to_move"
    room = [p for p in peers if p.worker_id != me and serves(p.role, "decode") and has_room(p, prompt_budget, step_tokens)]
    if not room:
        return None, "no_peer_with_room"
    if spread is not None and len(room) > 2:
        # Seeded by the request: the same answer for the same request and view (the simulator replays it).
        room = random.Random(zlib.crc32(spread.encode())).sample(room, 2)
    best = min(room, key=lambda p: (p.running, p.running_tokens))  # the first of equals
    if best.running < my_streams:
        return best.worker_id, "peer_decodes_fewer"
    if prompts_queued and best.running <= my_streams:
        return best.worker_id, "prompts_queued"
    return None, "fewest_streams_here"
