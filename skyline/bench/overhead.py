"""`skyline bench overhead`: what the fleet itself costs, with engines that cost nothing.

Starts Redis, a gateway and 1 prefill + 1 decode worker on the `sim` engine
with every timing set to zero, then measures from a client on the same machine:
  1. added latency: sequential requests, client-side TTFT (= gateway +
     Redis + both workers' handling, since the engines take no time), p50/p99;
  2. throughput: C concurrent streaming clients for D seconds: requests/s and
     streamed tokens/s through one gateway.
Everything (client included) shares this machine's cores, as a real
single-host deployment would.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
import os
import tempfile
import time
from pathlib import Path

import httpx

from skyline.bench.client import percentile, stream_completion
from skyline.bench.simfleet import SimFleet

SIM_TIMING = """
[engine]
sim_prefill_base_s = 0.0
sim_prefill_per_token_s = 0.0
sim_decode_base_s = {decode_step_s}
sim_decode_per_seq_s = 0.0
"""


def _start_fleet(workdir: Path, decode_step_s: float) -> tuple[SimFleet, str]:
    fleet = SimFleet(workdir, SIM_TIMING.format(decode_step_s=decode_step_s))
    fleet.start_redis()
    fleet.start_gateway()
    fleet.start_worker("prefill-0", "prefill")
    fleet.start_worker("decode-0", "decode", "--max-running", "256")
    try:
        # The gateway imports vLLM's serving layer at start (~10 s on a cold cache of this machine).
        fleet.wait_ready({"prefill": 1, "decode": 1}, timeout_s=180)
    except BaseException:
        fleet.stop()  # nothing left running when the fleet never came up
        raise
    return fleet, fleet.url


async def _latency(url: str, n: int) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        body = {"model": "skyline-sim", "prompt": "How long does the fleet itself take?", "max_tokens": 1}
        for _ in range(20):  # warm-up: connections, code paths
            await stream_completion(client, f"{url}/v1/completions", body)
        recs = [await stream_completion(client, f"{url}/v1/completions", body) for _ in range(n)]
    ttfts = [r.ttft_s * 1000 for r in recs if r.ok]
    return {"requests": n, "ok": len(ttfts), "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99)}


async def _throughput(url: str, concurrency: int, duration_s: float, max_tokens: int) -> dict:
    body = {"model": "skyline-sim", "prompt": "stream as fast as you can", "max_tokens": max_tokens, "ignore_eos": True}
    done: list = []
    stop_at = time.perf_counter() + duration_s

    async def user(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            done.append(await stream_completion(client, f"{url}/v1/completions", body))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ok = [r for r in done if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "concurrency": concurrency, "seconds": round(elapsed, 2), "requests_ok": len(ok), "requests_failed": len(done) - len(ok),
        "errors": dict(Counter(f"{r.status} {r.error[:120]}" for r in done if not r.ok)),
        "requests_per_s": len(ok) / elapsed, "streamed_tokens_per_s": tokens / elapsed,
        # Frames carry every token the engine produced since the last frame, so
        # SSE chunks/s (one per frame) is the fleet's message rate.
        "sse_chunks_per_s": chunks / elapsed,
        "ttft_p50_ms": percentile([r.ttft_s * 1000 for r in ok], 50),
        "ttft_p99_ms": percentile([r.ttft_s * 1000 for r in ok], 99),
    }


def run(n_latency: int = 300, concurrency: int = 32, duration_s: float = 20.0, max_tokens: int = 256,
        decode_step_ms: float = 0.0) -> dict:
    """`decode_step_ms` > 0 makes the sim engine emit one token per sequence per step, so
    every frame carries one token: the fleet's per-message cost instead of its batching."""
    with tempfile.TemporaryDirectory(prefix="skyline-overhead-") as tmp:
        fleet, url = _start_fleet(Path(tmp), decode_step_ms / 1000.0)
        try:
            result = {
                "machine": {"cpus": os.cpu_count()},
                "sim_decode_step_ms": decode_step_ms,
                "added_latency": asyncio.run(_latency(url, n_latency)),
                "throughput": asyncio.run(_throughput(url, concurrency, duration_s, max_tokens)),
            }
        finally:
            fleet.stop()
    return result


def main(args) -> None:
    result = run(args.requests, args.concurrency, args.duration, args.max_tokens, args.decode_step_ms)
    print(json.dumps(result, indent=2))
