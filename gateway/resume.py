"""Catching streams up after the token relay lost its connection (gateway/relay.py).

Pub/sub keeps nothing: frames published while the relay was away are gone
from the channel. But each frame is also in its request's frame log
(`keys.frames`, entry k = frame k, appended by the same script as the PUBLISH:
workers/runs.py), so once the relay has re-subscribed and Redis confirmed it,
reading the log from the frame after the last one delivered gives exactly what
was missed: what was published before the confirmation is in the log, what
comes after arrives live (held back until the log is delivered; duplicates
are dropped by `seq`). No gap, no duplicate.

That holds only if Redis kept its data. Two checks say whether it did:
- the **epoch** (`keys.epoch`): a random token set once and never expired;
  found missing or changed after a reconnect, Redis lost everything (restarted
  without persistence, or was flushed), queued requests included;
- per request: output already delivered but no run state, or a frame log
  shorter than what was delivered (a crash that lost AOF's last second).
Such a request fails with `redis_state_lost`; the rest continue.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from skyline.core.keys import Keys

STATE_LOST = "redis_state_lost"
DATA_LOST = "Redis lost its data while the gateway was reconnecting (restarted without persistence?)"


@dataclass
class Logged:
    """What Redis holds for one request, read after re-subscribing."""

    run_exists: bool  # its run hash (created by the hand-off or the first decode claim)
    logged: int  # frames in its frame log
    frames: list[bytes]  # the frame log from the frame after the last one delivered


def verdict(last_seq: int, data_kept: bool | None, state: Logged) -> str | None:
    """None if the request can go on from `state.frames`; else why it cannot (pure).

    `last_seq`: the last frame delivered (-1: none yet). `data_kept`: the epoch's
    answer (None: unknown, e.g. no epoch was read before the loss)."""
    if data_kept is False:
        return DATA_LOST
    if last_seq < 0:
        return None  # nothing delivered: still queued or starting; its frames are logged or come live
    if not state.run_exists:
        return "Redis came back without this request's run state"
    if state.logged < last_seq + 1:
        return (f"Redis came back with {state.logged} of the {last_seq + 1} frames already delivered "
                "(its last writes were lost)")
    return None


def new_token() -> bytes:
    return os.urandom(8).hex().encode()


async def check_epoch(r, keys: Keys, remembered: bytes | None) -> tuple[bool | None, bytes]:
    """(did Redis keep its data since `remembered` was read, the epoch now). Sets the epoch if
    there is none; None for the first answer, when there is nothing to compare."""
    pipe = r.pipeline(transaction=False)
    pipe.set(keys.epoch, new_token(), nx=True)
    pipe.get(keys.epoch)
    _, current = await pipe.execute()
    return (None if remembered is None else current == remembered), current


async def read_logged(r, keys: Keys, wanted: list[tuple[str, int]]) -> list[Logged]:
    """For each (request id, last seq delivered): its run state and frame log after that seq,
    in one round trip (all keys share the `{decode}` slot)."""
    if not wanted:
        return []
    pipe = r.pipeline(transaction=False)
    for rid, last_seq in wanted:
        pipe.exists(keys.run(rid))
        pipe.llen(keys.frames(rid))
        pipe.lrange(keys.frames(rid), last_seq + 1, -1)
    out = await pipe.execute()
    return [Logged(bool(out[i]), int(out[i + 1]), list(out[i + 2])) for i in range(0, len(out), 3)]
