"""`skyline bench burst`: one interactive chat sent right after a burst of long RAG prompts.

The situation of the SLO issue: six ~1,500-token `batch`-tier prompts arrive,
then, one second later, a short `interactive` chat. On plain vLLM the chat
waits for the prompts ahead of it, FCFS and with priority scheduling alike
(BENCHMARKS.md has the figures). This runs it on a Skyline fleet of real vLLM
engines (prefill on the first core, decode on the last) and prints the chat's
TTFT and the RAG prompts' TTFTs per trial. Each trial's RAG prompts are unique
(no prefix-cache hits between them or across trials). `--fleet elastic` runs the
default fleet of `make up` instead: two elastic workers, one per core
(scheduler/elastic.py); `--fleet disagg` (the default) the fixed pools.

`--min-remote-prefill-tokens N` is conditional disaggregation: prompts shorter
than N tokens are prefilled on the decode worker (no KV transfer, no wait for
the prefill engine's current step).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import openai

from skyline.tools.bench.simfleet import SimFleet

MODEL = "SmolLM2-135M-Instruct"
PASSAGE = ("The river rose slowly through the spring, carrying silt from the mountains to the delta, where "
           "farmers had learned over centuries to read its moods and plant accordingly. ")
CHAT = "What is the capital of France?"


def _ttft(client: openai.OpenAI, prompt: str, tier: str, max_tokens: int) -> float:
    t0 = time.monotonic()
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_headers={"x-slo-tier": tier}):
        if chunk.choices and chunk.choices[0].text:
            return time.monotonic() - t0
    return time.monotonic() - t0


def trial(client: openai.OpenAI, tag: str, n_rag: int = 6, delay_s: float = 1.0) -> dict:
    rag_ttfts: list[float] = []
    lock = threading.Lock()

    def rag(i: int) -> None:
        prompt = f"Document {tag}-{i}. " + PASSAGE * 50 + "\nSummarize the passage in one sentence."
        t = _ttft(client, prompt, "batch", 8)
        with lock:
            rag_ttfts.append(t)

    threads = [threading.Thread(target=rag, args=(i,)) for i in range(n_rag)]
    for t in threads:
        t.start()
    time.sleep(delay_s)
    chat = _ttft(client, CHAT, "interactive", 8)
    for t in threads:
        t.join()
    return {"chat_ttft_s": round(chat, 3), "rag_ttft_s": sorted(round(x, 2) for x in rag_ttfts)}


def run(min_remote_prefill_tokens: int, trials: int, workdir: Path, layout: str = "disagg") -> list[dict]:
    cfg = f"[gateway]\nmin_remote_prefill_tokens = {min_remote_prefill_tokens}\n"
    fleet = SimFleet(workdir, cfg, engine="vllm", extra=("--model", "default"))
    cores = sorted(os.sched_getaffinity(0))
    try:
        fleet.start_redis()
        fleet.start_gateway()
        if layout == "elastic":
            fleet.start_worker("elastic-0", "elastic", "--cpu-bind", str(cores[0]))
            fleet.start_worker("elastic-1", "elastic", "--cpu-bind", str(cores[-1]))
            fleet.wait_ready({"elastic": 2}, timeout_s=600)
        else:
            fleet.start_worker("prefill-0", "prefill", "--cpu-bind", str(cores[0]))
            fleet.start_worker("decode-0", "decode", "--cpu-bind", str(cores[-1]))
            fleet.wait_ready({"prefill": 1, "decode": 1}, timeout_s=600)
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=600)
        for _ in range(2):  # warm both engines
            client.completions.create(model=MODEL, prompt="warm up", max_tokens=4)
        return [trial(client, f"{min_remote_prefill_tokens}-{k}") for k in range(trials)]
    finally:
        fleet.stop()


def main(args) -> None:
    with tempfile.TemporaryDirectory(prefix="skyline-burst-") as tmp:
        results = run(args.min_remote_prefill_tokens, args.trials, Path(args.workdir or tmp), args.fleet)
    for k, r in enumerate(results):
        print(f"trial {k}: interactive TTFT {r['chat_ttft_s']:.2f} s; RAG TTFTs {r['rag_ttft_s']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"min_remote_prefill_tokens": args.min_remote_prefill_tokens,
                                              "fleet": args.fleet, "trials": results}, indent=2))
