"""`skyline bench overhead`: what the fleet itself costs, with engines that cost nothing.

Starts Redis, a gateway and 1 prefill + 1 decode worker on the `sim` engine
with every timing set to zero, and beside it the baseline: vLLM's own OpenAI
server over an engine that answers at once (skyline/tools/bench/instant_vllm.py).
Then, from a client on the same machine:
  1. added latency: sequential streamed requests (completions and chat), the
     two servers taking turns in rounds so that drift of this shared machine
     hits both alike. Skyline's client-side TTFT minus the baseline's is what
     the fleet adds over `vllm serve` (gateway + Redis + both workers + relay);
     the gateway's own breakdown of its TTFT comes from the responses'
     `skyline.gateway_timings`;
  2. throughput: C concurrent streaming clients for D seconds: requests/s and
     streamed tokens/s through one gateway.
Everything (client included) shares this machine's cores, as a real
single-host deployment would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from skyline.tools.bench.client import stream_completion

from skyline.core.net import free_port
from skyline.core.stats import percentile
from skyline.tools.bench.simfleet import SimFleet
from skyline.tools.otlp_receiver import OtlpReceiver

SIM_TIMING = """
[engine]
sim_prefill_base_s = 0.0
sim_prefill_per_token_s = 0.0
sim_decode_base_s = {decode_step_s}
sim_decode_per_seq_s = 0.0
"""


TRACING = """
[observability]
otlp_traces_endpoint = "{endpoint}"
"""


def _start_fleet(workdir: Path, decode_step_s: float, traces_endpoint: str = "") -> tuple[SimFleet, str]:
    config = SIM_TIMING.format(decode_step_s=decode_step_s)
    if traces_endpoint:  # every process exports its spans there (gateway and both workers)
        config += TRACING.format(endpoint=traces_endpoint)
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = SimFleet(workdir, config)
    fleet.start_redis()
    fleet.start_gateway()
    fleet.start_worker("prefill-0", "prefill")
    fleet.start_worker("decode-0", "decode", "--max-running", "256")
    try:
        # The gateway imports vLLM's serving layer at start, slowly on a cold file cache.
        fleet.wait_ready({"prefill": 1, "decode": 1}, timeout_s=180)
    except BaseException:
        fleet.stop()  # nothing left running when the fleet never came up
        raise
    return fleet, fleet.url


def _start_baseline(workdir: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server over the instant engine (skyline/tools/bench/instant_vllm.py)."""
    port = free_port()
    log = open(workdir / "instant-vllm.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "skyline.tools.bench.instant_vllm", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    _stop(proc)
    raise RuntimeError(f"the baseline vLLM server did not come up; see {workdir / 'instant-vllm.log'}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


PROMPT = "How long does the fleet itself take?"
REQUESTS = {
    "completions": ("/v1/completions", {"model": "skyline-sim", "prompt": PROMPT, "max_tokens": 1}),
    "chat": ("/v1/chat/completions",
             {"model": "skyline-sim", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}),
}


def _ms(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 3)


async def _latency(urls: dict[str, str], n: int, rounds: int = 6) -> dict:
    """Per endpoint, each system's client-side TTFT; the systems take turns, `n / rounds` requests a turn."""
    out: dict = {}
    async with httpx.AsyncClient(timeout=30) as client:
        for kind, (path, body) in REQUESTS.items():
            ttfts: dict[str, list[float]] = {name: [] for name in urls}
            breakdown: list[dict] = []
            for name, url in urls.items():  # warm-up: connections, code paths
                for _ in range(20):
                    await stream_completion(client, url + path, body)
            for _ in range(rounds):
                for name, url in urls.items():
                    for _ in range(max(1, n // rounds)):
                        rec = await stream_completion(client, url + path, body)
                        if rec.ok:
                            ttfts[name].append(rec.ttft_s * 1000)
                            if name == "skyline":
                                breakdown.append(rec.skyline.get("gateway_timings") or {})
            res = {name: {"ok": len(v), "ttft_p50_ms": _ms(v, 50), "ttft_p99_ms": _ms(v, 99)}
                   for name, v in ttfts.items()}
            if "vllm" in res and res["vllm"]["ok"] and res["skyline"]["ok"]:
                res["added_ttft_p50_ms"] = round(res["skyline"]["ttft_p50_ms"] - res["vllm"]["ttft_p50_ms"], 3)
            if TRACED in res and res[TRACED]["ok"] and res["skyline"]["ok"]:
                # What exporting every request's spans adds: the same fleet, traced, in the same rounds.
                res["tracing_added_ttft_p50_ms"] = round(
                    res[TRACED]["ttft_p50_ms"] - res["skyline"]["ttft_p50_ms"], 3)
            res["skyline"]["gateway_p50_ms"] = {
                k: _ms([b[k] for b in breakdown if b.get(k) is not None], 50)
                for k in ("render_ms", "enqueue_ms", "fleet_first_token_ms")}
            out[kind] = res
    return out


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


TRACED = "skyline-traced"


def run(n_latency: int = 300, concurrency: int = 32, duration_s: float = 20.0, max_tokens: int = 256,
        decode_step_ms: float = 0.0, baseline: bool = True, tracing: bool = False) -> dict:
    """`decode_step_ms` > 0 makes the sim engine emit one token per sequence per step, so
    every frame carries one token: the fleet's per-message cost instead of its batching.
    `tracing`: a second fleet, the same but exporting OpenTelemetry spans of every request to a real
    OTLP receiver, takes its turns in the added-latency rounds (`tracing_added_ttft_p50_ms`)."""
    with tempfile.TemporaryDirectory(prefix="skyline-overhead-") as tmp, contextlib.ExitStack() as stack:
        fleet, url = _start_fleet(Path(tmp) / "fleet", decode_step_ms / 1000.0)
        stack.callback(fleet.stop)
        urls = {"skyline": url}
        receiver = traced = None
        if tracing:
            receiver = stack.enter_context(OtlpReceiver())
            traced, urls[TRACED] = _start_fleet(Path(tmp) / "traced", decode_step_ms / 1000.0, receiver.endpoint)
            stack.callback(traced.stop)
        base = None
        if baseline:
            base, urls["vllm"] = _start_baseline(Path(tmp))
            stack.callback(_stop, base)
        result = {
            "machine": {"cpus": os.cpu_count()},
            "sim_decode_step_ms": decode_step_ms,
            "added_latency": asyncio.run(_latency(urls, n_latency)),
        }
        if receiver is not None and traced is not None:
            # Evidence that the traced fleet exported: its processes send their spans in batches (every
            # few seconds), so the last ones may still be on the way.
            deadline = time.monotonic() + 15
            while {s.service for s in receiver.spans} < {"skyline-gateway", "skyline-worker"} \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            result["tracing"] = {"spans_received": len(receiver.spans),
                                 "services": sorted({s.service for s in receiver.spans})}
            traced.stop()
        if base is not None:
            _stop(base)  # the throughput phase is the fleet's alone
        result["throughput"] = asyncio.run(_throughput(url, concurrency, duration_s, max_tokens))
    return result


def main(args) -> None:
    result = run(args.requests, args.concurrency, args.duration, args.max_tokens, args.decode_step_ms,
                 baseline=not args.no_baseline, tracing=args.tracing)
    print(json.dumps(result, indent=2))
