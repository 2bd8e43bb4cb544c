"""End to end with real vLLM engines and a real NIXL KV transfer.

One prefill engine pinned to core 0 and one decode engine pinned to core 1,
started once for this module (~1 min). Greedy output through the
disaggregated path must equal the same decode engine's colocated output
(prefill and decode in one engine) token for token, and the decode engine must
report that the prompt's KV came from the prefill engine. The fleet exports traces
to a real OTLP receiver: vLLM's own spans join each request's trace.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

from tests.fleet import Fleet
from skyline.tools.otlp_receiver import OtlpReceiver
from tests.procs import descendants, wait_gone, wait_until

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory, receiver):
    f = Fleet(redis_url, "e2e-vllm", "vllm", tmp_path_factory.mktemp("vllm-logs"),
              ["--model", "default", "--otlp-traces-endpoint", receiver.endpoint])
    cores = sorted(os.sched_getaffinity(0))
    # The decode worker takes vLLM engine arguments on its command line (issue 34): harmless for the
    # greedy answers compared here, visible in the config its engine logs.
    workers = {"prefill-0": ("prefill", "--cpu-bind", str(cores[0])),
               "decode-0": ("decode", "--cpu-bind", str(cores[-1]), "--seed", "7", "--max-num-seqs", "16")}
    with f.running(workers, timeout_s=600):
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout_s=120)


def test_chat_answer_is_correct_and_came_through_nixl(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content
    ext = resp.model_extra["skyline"]
    assert ext["route"] == "disagg" and ext["prefill_worker"] == "prefill-0" and ext["decode_worker"] == "decode-0"
    assert ext["kv_transfer"]["remote_prefill"] is True
    assert ext["kv_transfer"]["num_cached_tokens"] > 0, "decode engine did not load the prompt's KV remotely"


CASES = [
    ("chat", [{"role": "user", "content": "Name three colors of the rainbow."}]),
    ("chat", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]),
    ("completion", "The three laws of thermodynamics are"),
    ("completion", "def fibonacci(n):"),
]


def _run(client, kind, prompt, route, stream):
    headers = {"x-skyline-route": route}
    if kind == "chat":
        kw = dict(model=MODEL, messages=prompt, max_tokens=48, temperature=0, extra_headers=headers)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices), None
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.model_extra["skyline"]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, extra_headers=headers)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices), None
    r = client.completions.create(**kw)
    return r.choices[0].text, r.model_extra["skyline"]


def test_a_worker_runs_its_engine_with_the_vllm_arguments_it_was_given(fleet, client):
    """`skyline worker decode --seed 7 --max-num-seqs 16`: vLLM's own arguments reach the engine, which answers."""
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=4, temperature=0, extra_headers={"x-skyline-route": "colocated"})
    assert reply.choices[0].message.content
    engine_config = next(line for line in fleet.logs("decode-0", tail=10**6).splitlines()
                         if "Initializing a V1 LLM engine" in line)
    assert "seed=7," in engine_config
    assert "seed=7," not in next(line for line in fleet.logs("prefill-0", tail=10**6).splitlines()
                                 if "Initializing a V1 LLM engine" in line)


@pytest.mark.parametrize("kind,prompt", CASES)
def test_disaggregated_greedy_output_equals_colocated(client, kind, prompt):
    disagg, ext_d = _run(client, kind, prompt, "disagg", stream=False)
    coloc, ext_c = _run(client, kind, prompt, "colocated", stream=False)
    streamed, _ = _run(client, kind, prompt, "disagg", stream=True)
    assert disagg and disagg == coloc == streamed
    assert ext_d["kv_transfer"]["remote_prefill"] is True and ext_c["kv_transfer"]["remote_prefill"] is False


def test_concurrent_requests_all_complete(client):
    def one(i):
        r = client.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [16] * 6


def _descendants(root: int) -> dict[str, list[int]]:
    """Process name -> pids of every process below `root` (a worker's vLLM EngineCore and Worker)."""
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    out: dict[str, list[int]] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.setdefault(open(f"/proc/{child}/comm").read().strip(), []).append(child)
            todo.append(child)
    return out


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_each_engine_computes_on_the_core_it_was_bound_to(fleet, client):
    """vLLM's NIXL connector on CPU pins the thread that builds it, the one that computes, to the host's
    last core: unpatched, both engines of this fleet computed on core 1 (engine_processes.py)."""
    cores = sorted(os.sched_getaffinity(0))
    for name, core in (("prefill-0", cores[0]), ("decode-0", cores[-1])):
        [executor] = _descendants(fleet.procs[name].pid)["VLLM::Worker"]
        assert os.sched_getaffinity(executor) == {core}, name  # the main thread: OpenMP's master


def test_engine_core_process_sleeps_while_its_engine_computes(fleet, client):
    """vLLM's engine-core process would spin on its queue to the executor through every step (74% of
    a core measured for one engine alone); Skyline's plugin makes it sleep between looks."""
    [core] = _descendants(fleet.procs["decode-0"].pid)["VLLM::EngineCor"]  # names are cut to 15 chars
    cpu0, wall0 = _cpu_s(core), time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=f"Count from {i} to 200:", max_tokens=48, temperature=0,
            extra_headers={"x-skyline-route": "colocated"}, extra_body={"ignore_eos": True}), range(2)))
    share = (_cpu_s(core) - cpu0) / (time.monotonic() - wall0)
    assert share < 0.4, f"engine-core process used {share:.0%} of a core while its engine decoded"


def _engine_steps(redis_url) -> dict[tuple[str, str, str], float]:
    """(worker role, step kind, count|sum) -> value, from every worker's /metrics."""
    import json
    import subprocess
    import sys
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out = subprocess.run([sys.executable, "-m", "skyline.cli", "status", "--redis-url", redis_url,
                          "--key-prefix", "e2e-vllm", "--once", "--json"], capture_output=True, text=True,
                         timeout=60, check=True)
    steps = {}
    for w in json.loads(out.stdout)["workers"]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):  # the series carry the worker's model too
            for sample in family.samples:
                what = sample.name.removeprefix("skyline_worker_engine_step_seconds_")
                if what in ("count", "sum") and what != sample.name:
                    steps[(w["role"], sample.labels["kind"], what)] = sample.value
    return steps


def test_workers_export_each_engine_step(fleet, client, redis_url):
    """vLLM's per-step details reach the workers' /metrics: prefill steps on the prefill worker,
    decode steps on the decode worker, each with a time (what `skyline profile` predicts)."""
    client.completions.create(model=MODEL, prompt="Name three rivers:", max_tokens=8, temperature=0)
    steps = _engine_steps(redis_url)
    assert steps[("prefill", "prefill", "count")] >= 1 and steps[("prefill", "prefill", "sum")] > 0
    assert steps[("decode", "decode", "count")] >= 7 and steps[("decode", "decode", "sum")] > 0


def test_looser_tier_prompts_take_short_steps_and_strictest_tier_prompts_full_ones(client, redis_url):
    """The default step shape (scheduler/step_budget.py, 256-token steps): a standard-tier prompt
    alone in a decode worker's engine (colocated route) that has seen an interactive request goes 128
    tokens a step, an interactive one 256 (each prompt starts with its own words, so neither reuses
    the other's cached blocks)."""
    import math

    def prefill_steps(tier: str, opening: str) -> tuple[int, float]:
        before = _engine_steps(redis_url).get(("decode", "prefill", "count"), 0.0)
        r = client.completions.create(model=MODEL, prompt=opening + PASSAGE * 14, max_tokens=1, temperature=0,
                                      extra_headers={"x-slo-tier": tier, "x-skyline-route": "colocated"})
        return r.usage.prompt_tokens, _engine_steps(redis_url)[("decode", "prefill", "count")] - before

    # Background steps are for engines that have seen the strictest tier lately (step_budget.py).
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0,
                              extra_headers={"x-slo-tier": "interactive", "x-skyline-route": "colocated"})
    tokens, steps = prefill_steps("standard", "Orchard notes. ")
    assert tokens > 400 and steps >= math.ceil(tokens / 128)
    tokens, steps = prefill_steps("interactive", "Harbour logs. ")
    assert tokens > 400 and steps <= math.ceil(tokens / 256)


PASSAGE = (
    "The river rose slowly through the spring, carrying silt from the mountains to the delta, where "
    "farmers had learned over centuries to read its moods and plant accordingly. "
)


def test_interactive_request_overtakes_queued_rag_prompts(fleet, client, redis_url):
    """Six ~1,500-token batch-tier prompts, then one short interactive chat: EDF order,
    small prefill batches and fleet-level preemption let the chat go first."""
    import json
    import threading
    import time

    import redis

    from skyline.core.keys import Keys

    r, keys = redis.Redis.from_url(redis_url), Keys(fleet.key_prefix)
    rag_stream = keys.stream("prefill", "batch")
    queued_before = r.xlen(rag_stream)

    def burst_queued_and_computing() -> bool:
        """All six RAG prompts are on the prefill stream, and the prefill engine computes one of them."""
        if r.xlen(rag_stream) - queued_before < 6:
            return False
        rids = [f[b"id"].decode() for _, f in r.xrevrange(rag_stream, count=6)]
        events = [json.loads(e)["event"] for rid in rids for e in r.lrange(keys.timeline(rid), 0, -1)]
        return "prefill_started" in events

    rag_prompt = PASSAGE * 50 + "\nSummarize the passage in one sentence."  # ~1,500 tokens
    ttfts: dict[str, float] = {}

    def send(name, prompt, tier, max_tokens):
        t0 = time.monotonic()
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_headers={"x-slo-tier": tier})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and name not in ttfts:
                ttfts[name] = time.monotonic() - t0
        ttfts.setdefault(name, time.monotonic() - t0)

    threads = [threading.Thread(target=send, args=(f"rag-{i}", rag_prompt, "batch", 8)) for i in range(6)]
    for t in threads:
        t.start()
    wait_until(burst_queued_and_computing, 60, "the RAG burst queued, the prefill engine computing it")
    send("chat", "What is the capital of France?", "interactive", 8)
    for t in threads:
        t.join(timeout=300)
    rag = sorted(v for k, v in ttfts.items() if k.startswith("rag"))
    print(f"interactive TTFT {ttfts['chat']:.2f} s; RAG TTFTs {[round(x, 1) for x in rag]}")
    assert len(rag) == 6, "every RAG prompt must still complete"
    assert ttfts["chat"] < rag[len(rag) // 2], "the interactive request should not wait behind the RAG burst"
    r.close()


async def test_a_kv_pull_that_fails_is_computed_on_the_decode_worker(fleet, client, redis_url):
    """A NIXL failure, injected: the decode work of a served request goes to the decode pool again
    with a handle naming an engine nobody runs (its side channel refuses the handshake). vLLM ends
    the pull with an error before computing anything, and the decode worker computes the prompt
    itself: the same greedy text, shown in the final frame and the timeline and counted by reason."""
    import dataclasses
    import json
    import urllib.request

    import redis.asyncio as aioredis

    from skyline.core import messages
    from skyline.core.fleet import list_workers
    from skyline.core.keys import Keys
    from skyline.core.net import free_port
    from skyline.core.streams import enqueue, now_ms

    served = client.completions.create(model=MODEL, prompt="The moon is", max_tokens=16, temperature=0)
    keys = Keys(fleet.key_prefix)
    r = aioredis.from_url(redis_url)
    work = next(messages.decode(f[b"msg"]) for _, f in await r.xrange(keys.stream("decode", "standard"))
                if f[b"id"].decode() == served.id)
    assert work.kv_handle, "the request went through the prefill pool"
    rid, t = served.id + "-pull-fails", now_ms()
    bad = dataclasses.replace(
        work, request=dataclasses.replace(work.request, request_id=rid, arrival_ms=t, deadline_ms=t + 60_000),
        kv_handle=dict(work.kv_handle, remote_engine_id="no-such-engine", remote_port=free_port()),
        prefill_finished_ms=t)
    pubsub = r.pubsub()
    await pubsub.subscribe(keys.tokens(rid))
    await enqueue(r, keys, "decode", bad, 1000)
    text, final, deadline = "", None, time.monotonic() + 120
    while final is None and time.monotonic() < deadline:
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
        frame = messages.decode(msg["data"]) if msg else None
        assert not isinstance(frame, messages.Failed), frame
        if isinstance(frame, messages.TokenDelta):
            text += frame.text
        elif isinstance(frame, messages.Finished):
            final = frame
    assert final is not None, "no final frame: the stream hung"
    assert text == served.choices[0].text
    assert final.kv_transfer["local_prefill"] == "kv_pull_failed" and final.decode_worker == "decode-0"
    events = [json.loads(e) for e in await r.lrange(keys.timeline(rid), 0, -1)]
    assert any(e["event"] == "pd_fallback" and e["fields"]["reason"] == "kv_pull_failed" for e in events)
    worker = next(w for w in await list_workers(r, keys, 10) if w.worker_id == "decode-0")
    with urllib.request.urlopen(f"http://{worker.address}:{worker.metrics_port}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    fallbacks = [s for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == "skyline_worker_pd_fallbacks_total" and s.labels.get("reason") == "kv_pull_failed"]
    assert [s.value for s in fallbacks] == [1.0], fallbacks
    await pubsub.aclose()
    await r.aclose()


def test_a_client_that_leaves_in_any_phase_leaves_no_kv_blocks_on_either_engine(fleet, redis_url):
    """Streaming clients that go away while their request is queued, being prefilled, handed off
    but not yet pulled, and being decoded: after each, both engines' KV usage (what they report in
    their heartbeats) returns to its idle level within seconds. The hand-off is the phase vLLM does
    not cover by itself: the prefill engine keeps a finished prompt's blocks for its lease (60 s
    here) until a decode engine reads them; the decode worker that meets the client's tombstone
    frees them through vLLM's own rejection path instead (workers/decode.py)."""
    import json
    import signal
    import socket
    import uuid

    import redis

    from skyline.core.keys import Keys

    r, keys = redis.Redis.from_url(redis_url), Keys(fleet.key_prefix)
    prefill, decode = fleet.procs["prefill-0"], fleet.procs["decode-0"]

    def field(worker: str, name: str) -> float:
        return float(r.hget(keys.worker(worker), name) or 0)

    def wait_for(cond, timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout_s, what
            time.sleep(0.05)
        return time.monotonic() - t0

    def idle() -> bool:
        return field("prefill-0", "kv_usage") == 0 and field("decode-0", "kv_usage") == 0

    def newest(stage: str) -> str | None:
        got = r.xrevrange(keys.stream(stage, "standard"), count=1)
        return got[0][1][b"id"].decode() if got else None

    def send(words: int, max_tokens: int) -> tuple[socket.socket, str | None]:
        """A streaming completion on a raw socket (closing it is the client leaving, at any moment)."""
        before = newest("prefill")
        prompt = uuid.uuid4().hex + " the keeper climbed the stairs and watched the sea" * (words // 9)
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True}).encode()
        host, port = fleet.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"x-skyline-route: disagg\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: newest("prefill") != before, 10, "the request never reached the prefill stream")
        return sock, newest("prefill")

    def events(rid: str) -> list[str]:
        return [json.loads(e)["event"] for e in r.lrange(keys.timeline(rid), 0, -1)]

    wait_for(idle, 75, "the engines never became idle (blocks of an earlier test still under their lease?)")
    stopped: list[int] = []
    try:
        # Queued: the prefill worker is stopped while the client comes and goes.
        os.kill(prefill.pid, signal.SIGSTOP)
        stopped.append(prefill.pid)
        sock, rid = send(300, 8)
        sock.close()
        wait_for(lambda: r.get(keys.cancelled(rid)) == b"1", 10, "queued: no tombstone")
        os.kill(prefill.pid, signal.SIGCONT)
        stopped.remove(prefill.pid)
        wait_for(lambda: "cancelled" in events(rid), 10, "queued: the prefill worker did not drop it")
        wait_for(idle, 10, "queued: KV left behind")

        # Prefilling: a ~1,800-token prompt is being computed when the client leaves.
        sock, rid = send(1800, 8)
        wait_for(lambda: field("prefill-0", "kv_usage") > 0, 30, "prefilling: no KV in use")
        sock.close()
        took = wait_for(idle, 10, "prefilling: KV left behind")
        print(f"prefilling: idle {took:.1f} s after the client left")

        # Handed off, not pulled: the decode worker is stopped, so the prompt's blocks wait on the
        # prefill engine under their lease when the client leaves.
        os.kill(decode.pid, signal.SIGSTOP)
        stopped.append(decode.pid)
        sock, rid = send(400, 8)
        wait_for(lambda: "kv_handle_published" in events(rid), 30, "handed off: never handed off")
        wait_for(lambda: field("prefill-0", "kv_usage") > 0, 10, "handed off: the prefill engine holds nothing")
        sock.close()
        wait_for(lambda: r.get(keys.cancelled(rid)) == b"1", 10, "handed off: no tombstone")
        os.kill(decode.pid, signal.SIGCONT)
        stopped.remove(decode.pid)
        took = wait_for(idle, 15, "handed off: the prefill engine kept the blocks (lease 60 s)")
        print(f"handed off: idle {took:.1f} s after the decode worker resumed")
        wait_for(lambda: "kv_released" in events(rid), 5, f"handed off: no kv_released event: {events(rid)}")

        # Decoding: the client leaves a long answer after its first tokens.
        sock, rid = send(200, 1000)
        sock.recv(200)  # the response has begun: tokens are streaming
        wait_for(lambda: field("decode-0", "kv_usage") > 0, 10, "decoding: no KV in use")
        sock.close()
        took = wait_for(idle, 10, "decoding: KV left behind")
        print(f"decoding: idle {took:.1f} s after the client left")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    r.close()


def _second_decode_worker(fleet) -> None:
    """decode-1 beside decode-0, on its core, for the tests that need two. Not on the prefill
    engine's core: a decode engine there hung in its first KV pull from that engine, both engines'
    executors stalled until the prefill engine's lease of the blocks ran out (87 s; seen 3 of 3 times
    on 2026-12-03, the decode engine on the other core pulled in 0.4 s)."""
    if "decode-1" not in fleet.procs:
        cores = sorted(os.sched_getaffinity(0))
        fleet.start_worker("decode-1", "decode", "--cpu-bind", str(cores[-1]))
    fleet.wait_ready({"decode": 2}, timeout_s=600)


_DOC = ("The lighthouse stood on a rock at the edge of the bay. Every night its keeper climbed the stairs, "
        "trimmed the wick, wound the clockwork and watched the ships pass the reef. ") * 6


def _converse(client, history: str, question: str, **kw):
    prompt = history + question
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_headers={"x-skyline-route": "colocated"}, **kw)
    return prompt + r.choices[0].text, r.model_extra["skyline"]


def test_the_next_turn_is_served_where_the_first_was_cached_on_real_engines(fleet, client, redis_url, tmp_path):
    """Two decode engines: each conversation's later turns go to the engine that computed its first
    (vLLM's own KV cache events say what it holds), and report cached prompt tokens; a gateway with
    prefix affinity off places nothing."""
    import json
    import urllib.request

    import redis

    from skyline.core.keys import Keys
    from skyline.core.net import free_port
    from skyline.scheduler.prefix import block_chain

    _second_decode_worker(fleet)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(fleet.key_prefix)
    assert {int(r.hget(keys.worker(w), "cache_block_size")) for w in ("decode-0", "decode-1")} == {128}

    def view_holds(worker: str, prompt: str) -> bool:
        """Whether `worker`'s cache view (in Redis, what the gateway places by) holds every full block of
        `prompt`, tokenized as the gateway does (its /tokenize)."""
        req = urllib.request.Request(f"{fleet.url}/tokenize", json.dumps({"model": MODEL, "prompt": prompt}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            chain = block_chain(json.loads(resp.read())["tokens"], 128, 10_000)
        return bool(chain) and None not in r.zmscore(keys.kv_cache(worker), chain)

    convs = {c: f"Conversation {c}. {_DOC}" for c in range(3)}
    first: dict[int, str] = {}
    prompts: dict[int, str] = {}  # the last prompt of each conversation
    for c in convs:
        question = f"\nQ{c}: Who climbs the stairs?\nA:"
        prompts[c] = convs[c] + question
        convs[c], ext = _converse(client, convs[c], question)
        first[c] = ext["decode_worker"]
    for turn in range(2):
        # As between a user's turns, the views catch up: a worker mirrors its engine's cache events every 50 ms.
        wait_until(lambda: all(view_holds(first[c], prompts[c]) for c in convs), 10,
                   lambda: "each conversation's last prompt in its engine's cache view (missing for "
                           f"{[c for c in convs if not view_holds(first[c], prompts[c])]})")
        for c in convs:
            history, question = convs[c], f"\nQ{c}.{turn}: What does the keeper watch?\nA:"
            prompts[c] = history + question
            convs[c], ext = _converse(client, history, question)
            assert ext["placement"] and ext["placement"]["worker"] == first[c], ext
            assert ext["decode_worker"] == first[c]
            assert ext["kv_transfer"]["num_cached_tokens"] >= 256, ext["kv_transfer"]  # whole 128-token blocks

    # The same fleet behind a gateway with affinity off: nothing is placed, whoever claims first serves.
    (tmp_path / "off.toml").write_text("[gateway]\nprefix_affinity = false\n")
    port = free_port()
    fleet.start("gateway-off", ["gateway", *fleet._common(), "--port", str(port), "--config", str(tmp_path / "off.toml")])
    import openai

    off = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    deadline = time.monotonic() + 120
    while True:
        try:
            off.models.list()
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, fleet.logs("gateway-off")
            time.sleep(0.5)
    try:
        for c in convs:
            _, ext = _converse(off, convs[c], "\nQ: And then?\nA:")
            assert ext["placement"] is None
    finally:
        fleet.stop("gateway-off")


def test_decode_worker_killed_mid_stream_migrates_on_real_engines(fleet, client, redis_url):
    """It kills a decode worker (only the stall test follows it). A second decode engine joins;
    the one streaming a long greedy answer is killed -9; the other takes the
    request over (prefills prompt + tokens so far, generates the rest) and the
    client's stream continues: the whole text equals an undisturbed run. The killed
    worker's vLLM engine processes (engine core, executor) end with it: only the
    worker's pid gets the SIGKILL, as from `kill -9`, not its process group."""
    import signal
    import time

    import redis

    from skyline.core.keys import Keys

    prompt = "Write a long story about a lighthouse keeper and the sea."
    kw = dict(model=MODEL, prompt=prompt, max_tokens=96, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(**kw).choices[0].text
    _second_decode_worker(fleet)

    r = redis.Redis.from_url(redis_url)
    keys = Keys(fleet.key_prefix)
    text, ext, killed = "", {}, None
    for i, chunk in enumerate(client.completions.create(**kw, stream=True)):
        if chunk.choices:
            text += chunk.choices[0].text
        ext = (chunk.model_extra or {}).get("skyline") or ext
        if i == 8 and killed is None:
            rid = chunk.id
            killed = r.hget(keys.run(rid), "owner").decode()
            proc = fleet.procs.pop(killed)
            engine_procs = descendants(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            t_kill = time.monotonic()
    took = time.monotonic() - t_kill
    assert killed is not None
    # At least one takeover. On a starved 2-core machine the newly started worker can miss its
    # heartbeats and be taken over (and fenced) once more before the kill: still one correct stream.
    assert ext["decode_attempts"] >= 2 and ext["decode_worker"] != killed
    print(f"migrated after token {ext['resumed_at_token']}; rest of the stream took {took:.1f} s")
    assert text == want
    assert len(engine_procs) >= 1  # vLLM's engine core (and, on CPU, its executor)
    assert not wait_gone(engine_procs, timeout_s=15), "engine processes outlived their worker"


def test_a_decode_worker_whose_engine_stops_stepping_ends_itself_and_its_stream_migrates(fleet, client, redis_url,
                                                                                            tmp_path):
    """Last in this module. The engine of the decode worker streaming a greedy answer stops (its
    engine core and executor are sent SIGSTOP, as when the executor hung in a NIXL pull): the worker
    still heartbeats, but holds a request its engine no longer steps. Past `engine_stall_s` it says so,
    leaves the registry, kills its engine and exits with status 3; a live decode worker takes the
    stream over and the client's text equals an undisturbed run."""
    import signal

    import redis

    from skyline.core.keys import Keys
    from skyline.workers.engine_watch import EXIT_ENGINE_FAILED

    prompt = "Write a long story about a lighthouse keeper and a storm."
    kw = dict(model=MODEL, prompt=prompt, max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(**kw).choices[0].text
    (tmp_path / "stall.toml").write_text("[worker]\nengine_stall_s = 8\n")
    cores = sorted(os.sched_getaffinity(0))
    others = [n for n in fleet.procs if n.startswith("decode-")]
    fleet.start_worker("decode-stall", "decode", "--cpu-bind", str(cores[-1]), "--config", str(tmp_path / "stall.toml"))
    fleet.wait_ready({"decode": len(others) + 1}, timeout_s=600)

    r = redis.Redis.from_url(redis_url)
    keys = Keys(fleet.key_prefix)
    # The other decode workers sit out the claim: the stream goes to the worker whose engine will stop.
    for name in others:
        os.kill(fleet.procs[name].pid, signal.SIGSTOP)
    paused, text, ext, engine_procs = list(others), "", {}, []
    try:
        for i, chunk in enumerate(client.completions.create(**kw, stream=True)):
            if chunk.choices:
                text += chunk.choices[0].text
            ext = (chunk.model_extra or {}).get("skyline") or ext
            if i == 4 and not engine_procs:
                assert r.hget(keys.run(chunk.id), "owner") == b"decode-stall"
                for name in paused:
                    os.kill(fleet.procs[name].pid, signal.SIGCONT)
                paused = []
                engine_procs = descendants(fleet.procs["decode-stall"].pid)
                for pid in engine_procs:
                    os.kill(pid, signal.SIGSTOP)
                t_stop = time.monotonic()
    finally:
        for name in paused:
            os.kill(fleet.procs[name].pid, signal.SIGCONT)
    took = time.monotonic() - t_stop
    worker = fleet.procs.pop("decode-stall")
    assert worker.wait(timeout=30) == EXIT_ENGINE_FAILED
    log = (fleet.log_dir / "decode-stall.log").read_text(errors="replace")
    assert "gives up: its engine has held 1 request(s)" in log, log[-3000:]
    assert ext["decode_attempts"] >= 2 and ext["decode_worker"] in others, ext
    print(f"migrated after token {ext['resumed_at_token']}; the rest of the stream took {took:.1f} s")
    assert text == want
    assert len(engine_procs) >= 1
    assert not wait_gone(engine_procs, timeout_s=15), "the stopped engine's processes outlived their worker"


def test_vllm_engines_spans_join_the_request_trace_under_each_worker(client, receiver):
    """Each engine's own `llm_request` span (vLLM's tracing, given the worker's endpoint) is a child of the
    worker's span of the request, in the trace the client started (skyline/core/tracing.py)."""
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                   max_tokens=8, temperature=0,
                                   extra_headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})

    def engines_reported(spans) -> bool:
        return sum(s.name == "llm_request" for s in spans) >= 2 and sum(s.name == "skyline.worker" for s in spans) == 2

    spans = receiver.wait_for(trace_id, engines_reported, timeout_s=90)  # each process exports every 5 s
    assert engines_reported(spans), [(s.name, s.service) for s in spans]
    stays = {s.attributes["skyline.stage"]: s for s in spans if s.name == "skyline.worker"}
    engine_parents = {s.parent_id for s in spans if s.name == "llm_request"}
    assert {stays["prefill"].span_id, stays["decode"].span_id} <= engine_parents
    assert all(s.service == "skyline-worker" for s in spans if s.name == "llm_request")
