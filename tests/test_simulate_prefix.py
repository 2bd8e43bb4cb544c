"""The simulator's prefix caches and multi-turn sessions: what an engine keeps and evicts, what a hit
saves, how a session's turns share their prefixes and follow each other, and what affinity buys."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from skyline.core.config import load_config
from skyline.scheduler.prefix import block_chain
from skyline.tools.bench import metrics
from skyline.tools.bench.multiturn import MultiturnSpec
from skyline.tools.bench.workload import WorkloadSpec
from skyline.tools.simulate import sessions
from skyline.tools.simulate.fleet import FleetSpec, Simulation
from skyline.tools.simulate.prefix_cache import HolderIndex, PrefixCache
from skyline.tools.simulate.request import SimRequest
from tests.simmodels import HandModel


def _req(chain, prompt_tokens, max_tokens=1, block_size=4):
    r = SimRequest(0, "chat", "interactive", 0.0, prompt_tokens, max_tokens, 1e9, 1e9)
    r.chain, r.prompt_blocks = tuple(chain), prompt_tokens // block_size
    return r


def test_the_cache_keeps_the_most_recently_used_blocks_and_hits_only_a_leading_run():
    cache = PrefixCache(capacity_blocks=4, block_size=4)
    a = _req("abcdef", 17, max_tokens=8)  # 4 prompt blocks; prompt + answer - 1 = 24 tokens: 6 blocks
    assert cache.hit(a) == 0
    cache.store(a.chain, a.prompt_blocks)
    assert list(cache.blocks) == ["a", "b", "c", "d"]
    assert cache.hit(_req("abx", 12)) == 8  # a leading run only
    assert cache.hit(_req("abc", 12)) == 11  # never the whole prompt: vLLM computes its last token
    cache.finished(a)  # the answer's blocks too; the capacity evicts the least recently used
    assert list(cache.blocks) == ["c", "d", "e", "f"] and cache.evicted == 2
    assert cache.held(("a", "c"), 2) == 0 and cache.held(("c", "d", "e"), 3) == 3
    cache.hit(_req("cd", 8))  # used again: most recent, so e goes first, then f
    cache.store(("g",), 1)
    assert list(cache.blocks) == ["f", "c", "d", "g"]


def test_the_fleet_view_answers_what_each_cache_would():
    rng = random.Random(3)
    index = HolderIndex()
    caches = [PrefixCache(12, 4, f"w{i}", index) for i in range(5)]
    for _ in range(200):  # stores and evictions of chains that share prefixes
        c = rng.choice(caches)
        c.store([f"b{j}" for j in range(rng.randint(0, 3))] + [f"x{rng.randint(0, 9)}-{j}" for j in range(4)],
                rng.randint(1, 7))
    for c in caches:
        assert {h for h, ws in index.of.items() if c.name in ws} == set(c.blocks)
    for chain in (["b0", "b1", "b2", "x1-3"], ["b0", "x3-1"], ["x2-0", "x2-1"], ["b9"], []):
        want = {c.name: c.held(chain, len(chain)) for c in caches}
        assert index.matched(chain) == {w: n for w, n in want.items() if n}


def test_a_session_turn_extends_the_previous_prompt_and_answer_and_the_chain_is_the_gateways():
    spec = WorkloadSpec(mix=0.8, chat_prompt=(20, 60), rag_prompt=(300, 400), chat_output=(5, 20),
                        rag_output=(5, 20))
    first = sessions.synthetic(spec, MultiturnSpec(turns=(3, 4), think_s=1.0, rag_docs=2, max_prompt_tokens=800),
                               1.0, 30, lambda c: (1000, 100), 16)
    turns = [[r] for r in first]
    for t in turns:
        while t[-1].next_turn is not None:
            t.append(t[-1].next_turn)
    chats = [t for t in turns if t[0].cls == "chat"]
    assert chats and all(len(t) >= 3 for t in chats)
    for t in chats:
        for prev, nxt in zip(t, t[1:]):
            held = (prev.prompt_tokens + prev.max_tokens) // 16  # its prompt and answer, in whole blocks
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.max_tokens
            assert nxt.chain[:held] == prev.chain[:held] and nxt.think_s > 0
    system = sessions.SYSTEM_TOKENS // 16
    assert len({t[0].chain[:system] for t in turns}) == 1  # one system prompt for every session
    rag = [t[0] for t in turns if t[0].cls == "rag"]
    assert len({r.chain[:r.prompt_blocks - 2] for r in rag}) <= 2 < len(rag)  # questions over two documents
    # The chain is scheduler/prefix.py's, as the gateway hashes a prompt's token ids.
    ids = [random.Random(1).getrandbits(30) for _ in range(100)]
    assert sessions._chain(ids, 16) == tuple(block_chain(ids, 16, 512))


def _multiturn(workers: int, affinity: bool, rate: float = 2.0, n: int = 60):
    cfg = load_config(None)
    cfg = replace(cfg, gateway=replace(cfg.gateway, prefix_affinity=affinity, admission=False))
    model = HandModel("c", 2_000.0, max_step_tokens=512, step_s=0.02)
    model.block_size = 16
    spec = WorkloadSpec(mix=0.8, chat_prompt=(30, 200), rag_prompt=(600, 900), chat_output=(8, 32),
                        rag_output=(8, 32))
    reqs = sessions.synthetic(spec, MultiturnSpec(think_s=0.5), rate, n, lambda c: (2000, 1e9), 16)
    first = len(reqs)
    sim = Simulation(cfg, FleetSpec("colocated", 0, workers), model, model, prefix_cache=True)
    duration = sim.run(reqs, 120.0)
    return reqs, first, sim, metrics.summarize(reqs, duration)


def test_turns_are_sent_a_think_time_after_their_answer_and_affinity_keeps_histories_cached():
    reqs, first, _sim, with_affinity = _multiturn(4, True)
    assert len(reqs) > first and all(r.outcome == "ok" for r in reqs)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.send_at == pytest.approx(prev.send_at + prev.latency_s + nxt.think_s)
    _reqs, _first, _sim2, without = _multiturn(4, False)
    hit, hit_off = with_affinity["prefix_cache"]["hit_rate"], without["prefix_cache"]["hit_rate"]
    # The oracle (one infinite cache over what was sent before each first token) bounds both.
    sessions.add_oracle(reqs, 16)
    assert all(r.oracle_cached_tokens >= r.cached_tokens for r in reqs)
    oracle = metrics.summarize(reqs, 1.0)["prefix_cache"]["oracle_hit_rate"]
    assert hit <= oracle < hit + 0.1 and hit_off < oracle - 0.2, (hit, hit_off, oracle)
    # Four engines: without affinity a later turn finds its history where it was computed about 1 time in 4.
    assert hit > hit_off + 0.2, (hit, hit_off)
    assert with_affinity["ttft_ms"]["p50"] < without["ttft_ms"]["p50"]


def test_a_hit_saves_the_cached_tokens_prefill():
    cfg = replace(load_config(None), gateway=replace(load_config(None).gateway, admission=False))
    model = HandModel("c", 1_000.0, max_step_tokens=4096, step_s=0.01)
    model.block_size = 16
    ids = list(range(400))
    a = SimRequest(0, "chat", "interactive", 0.0, 320, 2, 1e9, 1e9)
    b = SimRequest(1, "chat", "interactive", 5.0, 400, 2, 1e9, 1e9)
    a.chain, a.prompt_blocks = sessions._chain(ids[:320] + [7, 7], 16), 20
    b.chain, b.prompt_blocks = sessions._chain(ids, 16), 25
    Simulation(cfg, FleetSpec("colocated", 0, 1), model, model, overhead_s=0.0, prefix_cache=True).run([a, b], 60)
    assert (a.cached_tokens, b.cached_tokens) == (0, 320)
    assert b.first_t - b.send_at == pytest.approx(0.080)  # 80 uncached tokens at 1,000 tokens/s
