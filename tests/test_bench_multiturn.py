"""The multi-turn workload and the prefix-cache oracle (pure), and the pieces the N-engine systems
are made of: the round-robin proxy (real sockets, no model) and the config file a system writes."""

from __future__ import annotations

import asyncio
import math
import tomllib
from pathlib import Path

import httpx
import pytest

from skyline.core.config import load_config
from skyline.core.net import free_port
from skyline.tools.bench import multiturn as mt
from skyline.tools.bench.client import RequestRecord
from skyline.tools.bench.config_file import with_changes
from skyline.tools.bench.metrics import summarize
from skyline.tools.bench.oracle import oracle_cached_tokens
from skyline.tools.bench.prompts import RAG_INSTRUCTION, PromptBuilder
from skyline.tools.bench.record import BenchRecord, cached_tokens
from skyline.tools.bench.tokenizer import SimTokenizer
from skyline.tools.bench.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parent.parent
# Sim tokens are bytes: the ~700-byte system prompt leaves RAG documents of a few hundred tokens.
SPEC = WorkloadSpec(mix=0.6, chat_prompt=(40, 200), rag_prompt=(1100, 1500), chat_output=(8, 16), seed=3)
MT = mt.MultiturnSpec(turns=(3, 5), think_s=1.5, rag_docs=3, max_prompt_tokens=1800)


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder(SimTokenizer())  # one token per byte, as the sim engine counts


def _conversation(builder, session, mt_spec=MT, answer="The answer, as the engine gave it. " * 2):
    """The requests a user would send, every answer being `answer` (None ends: the prompt bound)."""
    messages, out = mt.first_messages(session), []
    for turn in range(len(session.users)):
        if turn:
            messages = mt.next_messages(messages, answer, session.users[turn])
        req = mt.turn_request(session, turn, messages, builder, mt_spec, len(out), 0.0)
        if req is None:
            break
        out.append(req)
    return out


def test_sessions_are_seeded_and_each_rate_has_its_own_prefixes(builder):
    a, b = (mt.make_sessions(SPEC, MT, builder, 20, 1.0) for _ in range(2))
    assert a == b  # every system gets the same sessions
    other = mt.make_sessions(SPEC, MT, builder, 20, 2.0)
    assert other[0].system != a[0].system  # no rate finds the previous rate's system prompt cached
    assert {s.cls for s in a} == {"chat", "rag"} and sum(s.cls == "chat" for s in a) == 12  # the mix, exactly
    assert [s.start_at for s in a] == sorted(s.start_at for s in a) and a[0].start_at == 0
    for s in a:
        assert len({s.system for s in a}) == 1  # one shared system prompt
        if s.cls == "chat":
            assert MT.turns[0] <= len(s.users) <= MT.turns[1] and len(s.think_s) == len(s.users) - 1
            assert all(t >= 0 for t in s.think_s) and all(8 <= n <= 16 for n in s.max_tokens)
        else:
            assert len(s.users) == 1 and s.think_s == ()


def test_each_turn_is_the_previous_prompt_plus_its_answer_plus_a_new_message(builder):
    tok = builder.tok
    session = next(s for s in mt.make_sessions(SPEC, MT, builder, 20, 1.0) if s.cls == "chat")
    answer = "Bees shiver to keep warm."
    reqs = _conversation(builder, session, answer=answer)
    assert len(reqs) == len(session.users) >= 3
    for prev, req in zip(reqs, reqs[1:]):
        before, now = tok.apply_chat_template(list(prev.messages)), tok.apply_chat_template(list(req.messages))
        assert now[:len(before)] == before  # the whole previous prompt is a prefix of this one (in tokens)
        assert now[len(before):len(before) + len(tok.encode_answer(answer))] == tok.encode_answer(answer)
        assert req.prompt_tokens == len(now) > prev.prompt_tokens
        assert req.content == session.users[req.turn] and req.messages[0]["role"] == "system"
        assert (req.session, req.turn) == (session.index, prev.turn + 1)


def test_a_conversation_stops_before_its_prompt_exceeds_the_bound(builder):
    bound = mt.MultiturnSpec(turns=(5, 5), max_prompt_tokens=1200)
    sessions = [s for s in mt.make_sessions(SPEC, bound, builder, 30, 1.0) if s.cls == "chat"]
    cut = 0
    for s in sessions:
        reqs = _conversation(builder, s, bound, answer="x" * 150)
        assert all(r.prompt_tokens <= 1200 for r in reqs)
        cut += len(reqs) < len(s.users)
    assert cut > 0  # the bound did end some conversations early


def test_rag_prompts_too_short_for_a_document_are_refused(builder):
    with pytest.raises(ValueError, match="no room for a document"):
        mt.make_sessions(WorkloadSpec(mix=0.5, rag_prompt=(600, 800)), MT, builder, 4, 1.0)


def test_rag_questions_share_a_few_documents(builder):
    sessions = mt.make_sessions(SPEC, MT, builder, 40, 1.0)
    questions = [s.users[0] for s in sessions if s.cls == "rag"]
    docs = {q.split("\n\nQuestion: ")[0] for q in questions}
    assert len(docs) == MT.rag_docs  # 16 questions over 3 documents: each document asked about again
    # After the instruction they all start with, they differ from their first passage on.
    assert len({d[len(RAG_INSTRUCTION):][:64] for d in docs}) == MT.rag_docs
    for s in sessions:
        if s.cls == "rag":
            n = builder.count_messages(mt.first_messages(s))
            assert n <= MT.max_prompt_tokens and SPEC.rag_prompt[0] - 150 <= n <= SPEC.rag_prompt[1]


def test_the_oracle_counts_whole_blocks_of_the_longest_earlier_prefix():
    b = 4
    a = list(range(1, 11))  # 10 tokens: 2 whole blocks
    seq = [
        (a, [11, 12]),  # nothing before it
        ([*range(1, 13), 20, 21, 22], []),  # A's prompt + answer (3 blocks) then new tokens
        (list(range(1, 9)), []),  # all of it cached, but the last token is always computed: 1 block
        ([1, 2, 3, 9, 5, 6, 7, 8], []),  # differs inside the first block: nothing
        ([5, 6, 7, 8, 1, 2, 3, 4], []),  # A's blocks in another order: a block counts only after its prefix
        ([1, 2, 3, 9, 5, 6, 7, 8, 0, 0], []),  # the 4th request's prompt (not only the first's) is held
    ]
    assert oracle_cached_tokens(seq, b) == [0, 12, 4, 0, 0, 8]
    assert oracle_cached_tokens(seq, 16) == [0] * 6  # no prompt has a whole block of 16 before its last token


def _record(prompt: int, cached: int | None, oracle: int | None, outcome: str = "ok") -> BenchRecord:
    return BenchRecord("s", 1.0, 0, "chat", "interactive", prompt, 8, 0.0, outcome=outcome, server_prompt_tokens=prompt,
                       output_tokens=8, ttft_s=0.1, latency_s=0.5, cached_tokens=cached, oracle_cached_tokens=oracle)


def test_hit_rates_are_in_prompt_tokens_over_completed_requests():
    recs = [_record(100, 0, 0), _record(300, 150, 240), _record(1000, 500, 900, outcome="error")]
    pc = summarize(recs, 10.0)["prefix_cache"]
    assert pc["hit_rate"] == 150 / 400 and pc["oracle_hit_rate"] == 240 / 400
    assert pc["of_oracle"] == pytest.approx(150 / 240)
    none = summarize([_record(100, None, None)], 1.0)["prefix_cache"]  # a server that says nothing
    assert math.isnan(none["hit_rate"]) and math.isnan(none["oracle_hit_rate"]) and math.isnan(none["of_oracle"])
    # A disaggregated fleet says nothing of a prompt the prefill pool computed: the ratio leaves it out too.
    split = summarize([_record(300, 150, 240), _record(1000, None, 900)], 1.0)["prefix_cache"]
    assert split["hit_rate"] == 150 / 300 and split["oracle_hit_rate"] == 1140 / 1300
    assert split["of_oracle"] == pytest.approx(150 / 240)


def test_cached_tokens_come_from_skyline_or_from_openai_usage():
    assert cached_tokens(RequestRecord(skyline={"kv_transfer": {"num_cached_tokens": 64}})) == 64
    assert cached_tokens(RequestRecord(cached_tokens=128)) == 128  # vLLM's prompt_tokens_details
    assert cached_tokens(RequestRecord()) is None
    # A prompt a prefill worker computed: the decode engine's "cached" is the KV it pulled, not a hit.
    assert cached_tokens(RequestRecord(skyline={"kv_transfer": {"remote_prefill": True, "num_cached_tokens": 900}})) \
        is None


def test_routes_count_the_completed_requests_that_skipped_the_prefill_pool():
    def rec(route: str, turn: int, outcome: str = "ok") -> BenchRecord:
        r = _record(500, None, 0, outcome=outcome)
        r.skyline, r.turn = {"route": route}, turn
        return r

    recs = [rec("disagg", 0), rec("colocated", 0), rec("colocated", 1), rec("colocated", 2), rec("disagg", 1),
            rec("colocated", 1, outcome="cancelled")]
    assert summarize(recs, 1.0)["routes"] == {"colocated": 3, "disagg": 2,
                                              "later_turns": {"colocated": 2, "disagg": 1}}
    assert summarize([_record(100, 0, 0)], 1.0)["routes"] == {}  # not Skyline: nobody said


def test_every_system_is_listed_and_the_disagg_ones_stay_one_prefill_one_decode():
    import argparse

    from skyline.tools.bench.options import add_run_arguments
    from skyline.tools.bench.run import Bench
    from skyline.tools.bench.systems import SYSTEMS

    p = argparse.ArgumentParser()
    add_run_arguments(p)
    listed = next(a.help for a in p._actions if a.dest == "systems").split("Known: ")[1]
    assert sorted(n.strip() for n in listed.split(",")) == sorted(SYSTEMS)
    names = ["skyline-disagg-affinity", "skyline-disagg-no-affinity", "sim-disagg-affinity", "sim-disagg-no-affinity"]
    got = {s.name: (s.mode, s.engines, s.affinity, s.engine) for s in Bench._systems(",".join(names), 4)}
    assert got == {"skyline-disagg-affinity": ("disagg", 1, True, "vllm"),
                   "skyline-disagg-no-affinity": ("disagg", 1, False, "vllm"),
                   "sim-disagg-affinity": ("disagg", 1, True, "sim"),
                   "sim-disagg-no-affinity": ("disagg", 1, False, "sim")}


def test_a_block_size_reaches_every_vllm_engine_and_the_oracle_but_not_the_sim():
    from skyline.tools.bench.run import Bench
    from skyline.tools.bench.systems import cache_block_size

    specs = {s.name: s for s in Bench._systems("vllm-rr,skyline-affinity,sim-affinity", 2, 32)}
    assert {n: s.block_size for n, s in specs.items()} == {"vllm-rr": 32, "skyline-affinity": 32, "sim-affinity": 0}
    assert [cache_block_size(specs[n]) for n in ("vllm-rr", "skyline-affinity", "sim-affinity")] == [32, 32, 16]
    assert cache_block_size(Bench._systems("vllm-rr", 2)[0]) == 128  # vLLM's own on CPU
    with pytest.raises(SystemExit, match="--block-size"):
        Bench._systems("vllm-rr", 2, -16)


def test_the_affinity_off_config_keeps_every_other_setting(tmp_path):
    base = ROOT / "deploy" / "skyline.toml"
    path = with_changes(str(base), {"gateway": {"prefix_affinity": False}}, tmp_path / "off.toml")
    want = tomllib.loads(base.read_text())
    want["gateway"]["prefix_affinity"] = False
    assert tomllib.loads(Path(path).read_text()) == want
    assert load_config(path).gateway.prefix_affinity is False
    assert load_config(with_changes("", {"gateway": {"prefix_affinity": False}}, tmp_path / "d.toml")) \
        .gateway.prefix_affinity is False
    # a vLLM engine argument joins the file's [engine.vllm] table (`--block-size`: Bench.block_size)
    both = with_changes(path, {"engine": {"vllm": {"block-size": 32}}}, tmp_path / "block.toml")
    assert load_config(both).engine.kv_block_size == 32 and load_config(both).gateway.prefix_affinity is False


# -- the round-robin proxy, over two small servers that say who they are ---------------------------

async def _upstream(name: str, port: int):
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-upstream": name})
        await resp.prepare(request)
        await resp.write(f"data: {name} {body['n']} first\n\n".encode())
        await asyncio.sleep(0.5)  # the proxy must pass the first chunk on before the second exists
        await resp.write(b"data: second\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"server": name})

    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _through_proxy() -> tuple[list, list, int]:
    from aiohttp import web

    from skyline.tools.bench.rrproxy import make_app

    ports = [free_port(), free_port()]
    ups = [await _upstream(f"u{i}", p) for i, p in enumerate(ports)]
    dead = free_port()  # nobody listens here
    proxy_port = free_port()
    proxy = web.AppRunner(make_app([f"http://127.0.0.1:{p}" for p in ports]))
    await proxy.setup()
    await web.TCPSite(proxy, "127.0.0.1", proxy_port).start()
    broken = web.AppRunner(make_app([f"http://127.0.0.1:{dead}"]))
    await broken.setup()
    broken_port = free_port()
    await web.TCPSite(broken, "127.0.0.1", broken_port).start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy_port}", timeout=10) as client:
            streams = []
            for n in range(4):
                async with client.stream("POST", "/v1/chat/completions", json={"n": n}) as resp:
                    t0 = asyncio.get_running_loop().time()
                    lines = []
                    async for line in resp.aiter_lines():
                        if line:
                            lines.append((line, asyncio.get_running_loop().time() - t0))
                    streams.append((resp.headers["x-upstream"], lines))
                if n == 1:
                    await client.get("/v1/models")  # a GET goes to the first server: it does not move the turn
            models = [(await client.get("/v1/models")).json()["server"] for _ in range(2)]
            down = (await httpx.AsyncClient().post(f"http://127.0.0.1:{broken_port}/v1/chat/completions",
                                                   json={})).status_code
    finally:
        for r in (*ups, proxy, broken):
            await r.cleanup()
    return streams, models, down


def test_the_round_robin_proxy_alternates_and_streams_as_it_goes():
    streams, models, down = asyncio.run(_through_proxy())
    assert [name for name, _ in streams] == ["u0", "u1", "u0", "u1"]
    for n, (name, lines) in enumerate(streams):
        assert [text for text, _ in lines] == [f"data: {name} {n} first", "data: second"]
        first_at, second_at = lines[0][1], lines[1][1]
        assert first_at < 0.3 < second_at  # relayed as it came, not buffered to the end
    assert models == ["u0", "u0"]
    assert down == 502


def test_the_oracle_lets_a_request_hit_one_that_overtook_it():
    # A is sent first but B, sent 0.1 s later with the same 8-token prefix, is prefilled first:
    # A then finds B's blocks cached, so the bound must let it (send order alone would say 0).
    a, b = (list(range(1, 11)), []), ([*range(1, 9), 30, 31], [])
    assert oracle_cached_tokens([a, b], 4) == [0, 8]  # send order
    assert oracle_cached_tokens([a, b], 4, windows=[(0.0, 1.0), (0.1, 0.5)]) == [8, 8]
    assert oracle_cached_tokens([a, b], 4, windows=[(0.0, 0.05), (0.1, 0.5)]) == [0, 8]  # A done before B left
