"""vLLM's KV cache events as Skyline's block chain: the translation (vLLM's own event classes, no
engine), the reader over a real ZMQ socket, and one real vLLM engine reporting what it caches."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import vllm.distributed.kv_events as kv_events

from skyline.scheduler.prefix import block_chain
from skyline.workers.engines.base import CacheDelta
from skyline.workers.engines.vllm_kv_events import ChainState, KvEventReader, ipc_endpoint, translate

BlockStored, BlockRemoved, AllBlocksCleared = kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared
BS = 4
TOKENS = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens more
CHAIN = block_chain(TOKENS, BS, 100)


def stored(hashes, parent, tokens, *, medium="GPU", extra_keys=None, lora_name=None, block_size=BS):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                       lora_id=None, medium=medium, lora_name=lora_name, extra_keys=extra_keys, group_idx=0)


def removed(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


def holding_the_prompt() -> ChainState:
    """The engine stored TOKENS' 3 full blocks as vLLM 11, 12, 13, over two chunked-prefill steps."""
    state = ChainState(BS)
    translate([stored([11, 12], None, TOKENS[:8])], state)
    translate([stored([13], 12, TOKENS[8:12])], state)
    return state


def test_two_stores_chained_by_their_parent_are_the_prompts_block_chain():
    state = ChainState(BS)
    first = translate([stored([11, 12], None, TOKENS[:8])], state)
    second = translate([stored([13], 12, TOKENS[8:12])], state)
    assert first.stored + second.stored == CHAIN
    assert not (first.removed or first.cleared or second.removed or second.cleared)


def test_an_evicted_block_is_reported_by_its_skyline_hash_and_forgotten():
    state = holding_the_prompt()
    delta = translate([removed([12])], state)
    assert delta == CacheDelta(removed=[CHAIN[1]])
    assert 12 not in state.blocks
    # A block stored again under the forgotten parent is not guessed at.
    assert not translate([stored([14], 12, [1, 2, 3, 4])], state)


def test_a_block_whose_parent_was_never_seen_is_not_advertised_nor_are_its_children():
    state = ChainState(BS)
    assert not translate([stored([21], 999, TOKENS[4:8])], state)
    assert state.blocks[21].skyline is None  # held by the engine, known not to be advertised
    assert not translate([stored([22], 21, TOKENS[8:12])], state)
    assert not translate([removed([21, 22])], state)
    assert not state.blocks


def test_blocks_from_the_first_one_with_extra_keys_on_are_not_advertised():
    state = ChainState(BS)
    # cache_salt, as vLLM publishes it: on the first block only; the rest descend from it.
    salted = translate([stored([31, 32], None, TOKENS[:8], extra_keys=[("tenant-1",), None])], state)
    assert not salted and not translate([stored([33], 32, TOKENS[8:12])], state)
    # A multimodal item in the second block: the first is plain.
    delta = translate([stored([41, 42], None, TOKENS[:8], extra_keys=[None, ("image-digest", 0)])], state)
    assert delta.stored == CHAIN[:1]
    assert not translate([stored([43], 42, TOKENS[8:12])], state)
    assert not translate([stored([51], None, TOKENS[:4], lora_name="adapter")], state)


def test_offloaded_copies_and_partial_blocks_are_not_the_engines_cache():
    state = holding_the_prompt()
    assert not translate([stored([11], None, TOKENS[:4], medium="CPU")], state)
    assert not translate([removed([11], medium="CPU")], state)  # the engine's own copy stays
    assert state.blocks[11].skyline == CHAIN[0]
    assert not translate([stored([61], None, TOKENS[:2], block_size=2)], ChainState(BS))


def test_a_block_cached_twice_is_gone_only_when_both_copies_are():
    state = ChainState(BS)
    assert translate([stored([11], None, TOKENS[:4])], state).stored == CHAIN[:1]
    assert not translate([stored([11], None, TOKENS[:4])], state)  # a second request computed it too
    assert not translate([removed([11])], state)
    assert translate([removed([11])], state).removed == CHAIN[:1]


def test_a_batch_reports_its_net_change():
    state = holding_the_prompt()
    # Stored and evicted within one step: nothing to tell; evicted and stored again: unchanged.
    assert not translate([stored([14], 13, [5, 6, 7, 8]), removed([14]), removed([11]),
                          stored([11], None, TOKENS[:4])], state)


def test_all_blocks_cleared_empties_the_view():
    state = holding_the_prompt()
    delta = translate([removed([13]), AllBlocksCleared(), stored([11], None, TOKENS[:4])], state)
    assert delta == CacheDelta(stored=CHAIN[:1], cleared=True)
    assert list(state.blocks) == [11]


def test_a_gap_in_the_sequence_numbers_starts_the_view_over():
    state = ChainState(BS)
    assert translate([stored([11, 12], None, TOKENS[:8])], state, seq=0).stored == CHAIN[:2]
    # Batch 1 was lost: whatever it said is unknown, so what was held is no longer vouched for.
    delta = translate([stored([13], 12, TOKENS[8:12])], state, seq=2)
    assert delta == CacheDelta(cleared=True)  # its parent is forgotten with the rest
    assert translate([stored([11], None, TOKENS[:4])], state, seq=3) == CacheDelta(stored=CHAIN[:1])


def test_the_reader_drains_the_publishers_socket_without_blocking():
    import msgspec
    import zmq

    endpoint = ipc_endpoint()
    reader = KvEventReader(endpoint, block_size=BS)
    # XPUB: on the wire a PUB socket, as vLLM's publisher is, that also reads its subscribers' subscriptions.
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.bind(endpoint)
    encode = msgspec.msgpack.Encoder().encode

    def publish(seq, *events):  # the frames vLLM's ZmqEventPublisher sends
        pub.send_multipart((b"", seq.to_bytes(8, "big"), encode(kv_events.KVEventBatch(ts=time.time(), events=list(events)))))

    try:
        assert reader.poll() is None
        assert pub.poll(10_000, zmq.POLLIN), "the reader's subscription never reached the publisher"
        assert pub.recv() == b"\x01"  # subscribed to every topic
        publish(0, stored([11, 12], None, TOKENS[:8]))
        publish(1, stored([13], 12, TOKENS[8:12]), removed([11]))
        # Not an event the test can see: that both batches wait in the reader's socket is known only by
        # draining it, which is the call under test (its answer, one netted delta, needs both there).
        time.sleep(0.3)
        assert reader.poll() == CacheDelta(stored=CHAIN[1:3])  # both batches, in one delta
        assert reader.poll() is None
        publish(3, stored([11], None, TOKENS[:4]))  # batch 2 lost
        assert _poll_until(reader.poll, lambda d: d is not None) == CacheDelta(stored=CHAIN[:1], cleared=True)
    finally:
        pub.close(0)
        reader.close()
    assert not os.path.exists(endpoint.removeprefix("ipc://"))


def _poll_until(poll, done, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = poll()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


# ---- one real engine ---------------------------------------------------------------------------

VOCAB_LOW = 1000  # plain token ids of the default model's vocabulary (49,152)


@pytest.fixture(scope="module")
async def engine():
    """One VllmEngine for the module, with a KV cache of 12 blocks of 128 tokens (~0.07 GiB at float32
    for the default model), so that a few prompts of 700 tokens evict each other."""
    from skyline.tools.model import resolve_model
    from skyline.workers.engines.vllm_engine import VllmEngine

    env = dict(os.environ)  # the engine sets vLLM's variables in this process for its children
    eng = VllmEngine(resolve_model("default"), max_model_len=1024, kv_cache_gib=0.07, kv_transfer=False,
                     max_num_batched_tokens=256)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()
        os.environ.clear()
        os.environ.update(env)


class Mirror:
    """What a worker makes of the deltas: the set of Skyline hashes its engine holds."""

    def __init__(self):
        self.held: set[str] = set()
        self.stored: list[str] = []
        self.removed: list[str] = []
        self.cleared = False

    def apply(self, d: CacheDelta | None) -> None:
        if d is None:
            return
        if d.cleared:
            self.held.clear()
            self.cleared = True
        self.held.difference_update(d.removed)
        self.held.update(d.stored)
        self.stored += d.stored
        self.removed += d.removed


async def _run(eng, name: str, ids: list[int], mirror: Mirror, until) -> None:
    """Generate one token for `ids`, then mirror the engine's deltas until `until(mirror)` (events
    come from the engine core's publisher thread, just after the step that caused them)."""
    from skyline.core.messages import SamplingSpec
    from skyline.workers.engines.base import EngineRequest

    async for _ in eng.generate(EngineRequest(name, ids, SamplingSpec(max_tokens=1, temperature=0.0)), None):
        mirror.apply(eng.cache_delta())
    deadline = time.monotonic() + 10
    while not until(mirror) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        mirror.apply(eng.cache_delta())


@pytest.mark.vllm
async def test_a_real_engine_reports_its_prefix_cache_as_skyline_blocks(engine):
    bs = engine.cache_block_size
    assert bs == engine._llm.vllm_config.cache_config.block_size > 0
    chain = lambda ids: block_chain(ids, bs, 1000)  # noqa: E731
    a = [VOCAB_LOW + i for i in range(700)]

    # A prompt prefilled in chunks of 256 tokens: its 5 full blocks, in order, nothing else.
    m = Mirror()
    await _run(engine, "a", a, m, lambda m: len(m.stored) >= 5)
    assert m.stored == chain(a) and len(chain(a)) == 700 // bs and not m.removed

    # Another prompt sharing a's first 512 tokens: only the block after the shared ones is new.
    b = a[:512] + [VOCAB_LOW + 5000 + i for i in range(188)]
    m = Mirror()
    await _run(engine, "b", b, m, lambda m: m.stored)
    assert m.stored == chain(b)[4:]

    # Two more prompts of 5 blocks each do not fit next to a and b (11 usable blocks): evictions
    # come back as removed hashes of blocks reported before.
    m = Mirror()
    for k in range(2):
        c = [VOCAB_LOW + 10_000 + 1000 * k + i for i in range(700)]
        await _run(engine, f"c{k}", c, m, lambda m, c=c: set(chain(c)) <= m.held)
    assert m.removed and set(m.removed) <= set(chain(a)) | set(chain(b)) | set(m.stored)
    assert set(chain(c)) <= m.held and not m.held & set(m.removed)

    # A reset of the prefix cache reaches the view with the next step's events.
    assert await engine._llm.reset_prefix_cache()
    m = Mirror()
    await _run(engine, "a-again", a, m, lambda m: m.cleared and len(m.held) >= 5)
    assert m.cleared and m.held == set(chain(a))
