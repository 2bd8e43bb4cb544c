"""End to end: two elastic workers on real vLLM engines (one core each) with real NIXL transfers.

Every engine takes either phase (scheduler/elastic.py): a prompt from the prefill streams is either
served whole by the engine that claimed it or computed there and decoded by the other engine, its KV
pulled over NIXL, in either direction. Greedy text must be the same whichever way a request went.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from tests.fleet import Fleet

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"
LONG = "Here is a story about a quiet town by the sea. " * 40 + "\nSummarize the story in one sentence."
SHORT = {True: "What is the capital of France?", False: "The three laws of thermodynamics are"}  # chat / text


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    # The default gateway routing: prompts under 256 tokens take the decode streams, longer ones the prefill streams.
    # The phase mix off (scheduler/elastic.py `long_engines`): with it, the engine that keeps the long prompts
    # hands every decode to the other, one direction only; this test wants both (tests/test_elastic_workers.py
    # has the phase mix's own).
    logs = tmp_path_factory.mktemp("elastic-logs")
    config = logs / "skyline.toml"
    config.write_text("[worker]\nphase_mix = false\n")
    f = Fleet(redis_url, "e2e-elastic", "vllm", logs, ["--model", "default", "--config", str(config)], gateway_args=())
    cores = sorted(os.sched_getaffinity(0))
    # 1024-token steps: a decode is handed only to a peer whose next step has room beside its own prompts
    # (`elastic.has_room`, on the peer's newest heartbeat), and with the default 256-token step a peer
    # computing one of the ~450-token prompts below never has; this test is about the text, not the rule.
    step = ("--max-num-batched-tokens", "1024")
    workers = {"elastic-0": ("elastic", "--cpu-bind", str(cores[0]), *step),
               "elastic-1": ("elastic", "--cpu-bind", str(cores[-1]), *step)}
    with f.running(workers, timeout_s=600):
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout_s=180)


def _ask(client, prompt: str, chat: bool, route: str | None = None):
    headers = {"x-skyline-route": route} if route else {}
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                           temperature=0, extra_headers=headers)
        return r.choices[0].message.content, r.model_extra["skyline"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_headers=headers)
    return r.choices[0].text, r.model_extra["skyline"]


@pytest.mark.parametrize("chat", [True, False])
def test_short_and_long_prompts_answer_as_one_engine_does_whichever_way_they_went(client, chat):
    directions: set[tuple[str, str]] = set()
    # Concurrent long prompts: some are handed on, in both directions. Which engine claims which prompt is
    # a race between their loops, so a round may hand on one way only (CI 2026-12-06: four rounds in a
    # row did); rounds go on until both directions were seen, and most runs stop after one or two.
    for n in range(10):
        # Prompts no engine holds yet (a cached one skips the prefill streams, as a short one does).
        prompts = [f"Story {n}.{i} ({'chat' if chat else 'text'}). {LONG}" if i % 3 else SHORT[chat] for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: _ask(client, p, chat), prompts))
        for prompt, (text, ext) in zip(prompts, answers):
            # The reference: the same prompt computed and decoded by one engine (the colocated route).
            assert text and text == _ask(client, prompt, chat, route="colocated")[0], (prompt[:20], ext)
            if ext["kv_transfer"].get("remote_prefill"):
                assert ext["prefill_worker"] != ext["decode_worker"]
                directions.add((ext["prefill_worker"], ext["decode_worker"]))
        if len(directions) == 2:
            break
    assert directions == {("elastic-0", "elastic-1"), ("elastic-1", "elastic-0")}, directions
