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

The phase mix (`long_engines`): where a fleet's load mixes long prompts (the
prefill streams') with short ones (the colocated route's), every step that
computes a long prompt's chunk slows the streams of the engine it runs on past
a chat's TPOT target, and a chat claimed beside it waits for the chunk. So some
of the elastic engines keep the long prompts and hand every decode on, as a
prefill worker does, and the others take the short prompts and the streams;
how many follows the share of long-prompt tokens the fleet computed in the
last `MIX_WINDOW_S`, read from the heartbeats, so every worker finds the same
split. A load of one kind (only chats, only long prompts) splits nothing: every
engine takes either phase. With a split, each side leaves the other's work to a
peer of that kind with room, as a fixed fleet's pools would, unless its engine
holds nothing (`claiming.leaves_until_due`).
"""

from __future__ import annotations

import random
import zlib
from collections import deque
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


# How far back a worker's heartbeat counts the prompt tokens it claimed, long and short (`long_engines`):
# several of the mixed benchmark's RAG prompts at its lowest rate, so the split outlasts the gaps between them.
MIX_WINDOW_S = 30.0


class MixLoad(Protocol):
    """What a worker's heartbeat says of the prompts it claimed in the last `MIX_WINDOW_S`."""

    worker_id: str
    role: str
    long_tokens: int  # prompt tokens of the prefill streams' prompts (long ones)
    short_tokens: int  # prompt tokens of the colocated route's prompts (short ones)


class MixWindow:
    """The prompt tokens one worker claimed in the last `MIX_WINDOW_S`, long and short: what its heartbeat
    says (`MixLoad`). Times in any one clock."""

    def __init__(self, window_s: float = MIX_WINDOW_S) -> None:
        self.window_s = window_s
        self._claims: deque[tuple[float, int, bool]] = deque()  # (when, tokens, long), oldest first

    def add(self, now: float, tokens: int, long: bool) -> None:
        self._claims.append((now, tokens, long))

    def totals(self, now: float) -> tuple[int, int]:
        """(long-prompt tokens, short-prompt tokens) claimed in the window ending at `now`."""
        while self._claims and self._claims[0][0] <= now - self.window_s:
            self._claims.popleft()
        long_tokens = sum(t for _w, t, is_long in self._claims if is_long)
        return long_tokens, sum(t for _w, t, _l in self._claims) - long_tokens


def long_engines(workers: Iterable[MixLoad], current: frozenset[str] = frozenset()) -> frozenset[str]:
    """The elastic workers (of the live `workers`) whose engines keep the long prompts: as many as the
    long prompts' share of the prompt tokens the fleet claimed in the window, rounded down, at least one
    and at most half of them; none while either kind is missing or with fewer than two elastic workers. The
    ones that claimed the most long-prompt tokens, so the split stays where it is as long as the load
    does; among equals those in `current` (the split so far: a short engine that took one long prompt
    while both were idle does not swap the roles), then by worker id (every worker reading the same
    heartbeats finds the same engines)."""
    elastic = [w for w in workers if w.role == "elastic"]
    long_tokens = sum(w.long_tokens for w in elastic)
    short_tokens = sum(w.short_tokens for w in elastic)
    if len(elastic) < 2 or long_tokens <= 0 or short_tokens <= 0:
        return frozenset()
    n = len(elastic)
    # Rounded down, and at most half: the other engines take the short prompts and every stream too.
    k = min(max(1, n // 2), max(1, n * long_tokens // (long_tokens + short_tokens)))
    ranked = sorted(elastic, key=lambda w: (-w.long_tokens, w.worker_id not in current, w.worker_id))
    return frozenset(w.worker_id for w in ranked[:k])


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


def handoff_step_tokens(why: str, step_tokens: int) -> int:
    """The step budget a hand-off placed for `why` asks its peer to have room in (`has_room`; 0: the
    step is not asked): a long engine's hand-off (`long_prompts_here`) does not ask it."""
    return 0 if why == "long_prompts_here" else step_tokens


def decoder_for(me: str, my_streams: int, peers: Iterable[PeerLoad], prompts_queued: bool,
                prompt_budget: int = 0, spread: str | None = None, step_tokens: int = 0,
                prompt_tokens: int = 0, min_move_tokens: int = 0,
                long_here: frozenset[str] = frozenset()) -> tuple[str | None, str]:
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
    a fleet of two or three engines has at most two peers to choose from and is unchanged.

    `long_here`: the engines that keep the long prompts (`long_engines`): one of them hands every decode
    on to a peer with room, as a prefill worker does, and none is given one. Its peer's room leaves its
    step out (`handoff_step_tokens`): the peer's own prompts there are short ones, done in a step or two,
    where the stream kept here would run beside the next long prompt's chunks for all of theirs."""
    if prompt_tokens and prompt_tokens < min_move_tokens:
        return None, "too_short_to_move"
    step_tokens = handoff_step_tokens("long_prompts_here" if me in long_here else "", step_tokens)
    room = [p for p in peers if p.worker_id != me and p.worker_id not in long_here and serves(p.role, "decode")
            and has_room(p, prompt_budget, step_tokens)]
    if not room:
        return None, "no_peer_with_room"
    if spread is not None and len(room) > 2:
        # Seeded by the request: the same answer for the same request and view (the simulator replays it).
        room = random.Random(zlib.crc32(spread.encode())).sample(room, 2)
    best = min(room, key=lambda p: (p.running, p.running_tokens))  # the first of equals
    if me in long_here:
        return best.worker_id, "long_prompts_here"
    if best.running < my_streams:
        return best.worker_id, "peer_decodes_fewer"
    if prompts_queued and best.running <= my_streams:
        return best.worker_id, "prompts_queued"
    return None, "fewest_streams_here"
