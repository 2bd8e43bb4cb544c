"""`skyline profile --handoff`: time the decode side of a disaggregated hand-off between two real engines.

What the simulator needs to know about a hand-off, and `skyline profile`
alone cannot measure (it needs a second engine): how long after a decode
engine is given a request with a KV handle its first token comes out. Two
engines are built exactly as the workers build them (NIXL connector loaded,
each pinned to its cores): a prefill engine in this process and a decode
engine in a child process (vLLM reads its settings from the environment when
an engine is spawned, so one engine per process, as in the fleet). For each
prompt length:

  prefill_s       the prefill engine's `prefill()` (max_tokens=1, KV kept);
  first_token_s   decode engine: `generate()` with the handle -> first token
                  (KV pull over NIXL, scheduling, the step that samples it);
  decode_step_s   the median gap between the following tokens (one sequence);
  pull_s          first_token_s - decode_step_s: what the hand-off costs
                  beyond the one decode step the simulator already models.

`pull_s` is fitted as latency + bytes / bandwidth into the profile's
`kv_transfer` (replacing the hand measurement `skyline profile` records), and
every point is kept under `handoff` so the fit can be checked. The first
hand-off between two engines (NIXL handshake) is timed separately.

A second figure measures what one engine's neighbour costs it: prefill times
on the prefill engine while the decode engine is busy decoding a batch, over
the same prompts with the decode engine idle (`neighbour_slowdown`).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import statistics
import time
from datetime import UTC, datetime

HANDOFF_TOKENS = (32, 128, 256, 512, 1024, 1536)
HANDOFF_OUTPUT = 8  # tokens generated on the decode engine per hand-off: 1 + 7 decode steps
NEIGHBOUR_TOKENS = (256, 1024)
NEIGHBOUR_BATCH = (8, 128, 96)  # sequences, prompt tokens, output tokens the busy neighbour decodes
REPEATS = 3


def fit_pull(points: list[dict], kv_bytes_per_token: float) -> tuple[float, float | None]:
    """(latency s, bytes/s) of pull_s = latency + tokens x kv bytes / bandwidth, least squares.

    A bandwidth that the points cannot resolve (slope <= 0: the transfer is
    lost in the noise of the fixed cost) is None: no per-byte term.
    """
    xs = [p["tokens"] * kv_bytes_per_token for p in points]
    ys = [p["pull_s"] for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        return max(0.0, statistics.median(ys)), None
    return max(0.0, my - slope * mx), 1.0 / slope


# -- the decode engine, in a child process ----------------------------------------------------------


def _decode_child(conn, engine_cfg, model_dir: str) -> None:
    asyncio.run(_decode_serve(conn, engine_cfg, model_dir))


async def _decode_serve(conn, engine_cfg, model_dir: str) -> None:
    from skyline.workers.main import build_engine

    engine = build_engine(engine_cfg, model_dir)
    await engine.start()
    conn.send(("ready", engine.start_seconds))
    loop = asyncio.get_running_loop()
    background: asyncio.Task | None = None
    try:
        while True:
            cmd, payload = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                break
            if cmd == "handoff":
                req, handle = payload
                t0 = time.perf_counter()
                times = []
                async for chunk in engine.generate(req, handle):
                    if chunk.token_ids:
                        times.append(time.perf_counter())
                    if chunk.finish_reason:
                        evidence = chunk.kv_transfer
                gaps = [b - a for a, b in itertools.pairwise(times)]
                conn.send((times[0] - t0, statistics.median(gaps) if gaps else None, evidence))
            elif cmd == "busy":  # decode a batch in the background until told to stop
                if background is None:
                    background = asyncio.ensure_future(_decode_forever(engine, payload))
                await asyncio.sleep(2.0)  # every sequence prefilled: the engine is decoding
                conn.send("busy")
            elif cmd == "idle":
                if background is not None:
                    background.cancel()
                    await asyncio.gather(background, return_exceptions=True)
                    background = None
                    for r in list(engine._in_flight):  # abort what the cancelled batch left in the engine
                        await engine.abort(r)
                await asyncio.sleep(1.0)
                conn.send("idle")
    finally:
        await engine.shutdown()


async def _decode_forever(engine, batches) -> None:
    """Keep the engine decoding: a fresh batch from `batches()` as soon as the previous one is done."""

    async def drain(r):
        async for _ in engine.generate(r, None):
            pass

    while True:
        await asyncio.gather(*(drain(r) for r in batches()))


class _BusyBatch:
    """Picklable factory of the neighbour's batch: fresh random prompts every round (no prefix-cache hits)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed, self.round = vocab, seed, 0

    def __call__(self):
        import random

        from skyline.core.messages import SamplingSpec
        from skyline.workers.engines.base import EngineRequest

        self.round += 1
        rng = random.Random(f"{self.seed}:{self.round}")
        n, prompt, output = NEIGHBOUR_BATCH
        return [EngineRequest(f"busy-{self.round}-{i}", [rng.randrange(100, self.vocab - 1) for _ in range(prompt)],
                              SamplingSpec(max_tokens=output, temperature=0.0, ignore_eos=True)) for i in range(n)]


# -- the measurement --------------------------------------------------------------------------------------


async def measure(args, prompts, kv_bytes_per_token: int, model_dir: str, vocab: int) -> dict:
    """Hand-off points and the neighbour slowdown; `prompts` makes fresh random-token requests."""
    from dataclasses import replace

    from skyline.core.config import EngineConfig
    from skyline.core.net import free_port
    from skyline.workers.main import build_engine

    base = EngineConfig(kind="vllm", model=args.model, kv_transfer=True, kv_cache_gib=args.kv_cache_gib)
    decode_cfg = replace(base, cpu_bind=args.decode_cpu_bind, nixl_port=free_port())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_child, args=(child, decode_cfg, model_dir))
    proc.start()
    loop = asyncio.get_running_loop()

    async def ask(cmd, payload=None):
        parent.send((cmd, payload))
        return await loop.run_in_executor(None, parent.recv)

    _ready, decode_start = await loop.run_in_executor(None, parent.recv)
    engine = build_engine(replace(base, cpu_bind=args.cpu_bind, nixl_port=free_port()), model_dir)
    await engine.start()

    async def handoff(tokens: int) -> dict:
        req = prompts.make(tokens)
        t0 = time.perf_counter()
        result = await engine.prefill(req)
        prefill_s = time.perf_counter() - t0
        req.sampling.max_tokens = HANDOFF_OUTPUT
        first, step, evidence = await ask("handoff", (req, result.kv_handle))
        if not evidence.get("num_remote_tokens"):
            raise RuntimeError(f"the decode engine did not pull the KV over NIXL: {evidence}")
        return {"tokens": tokens, "prefill_s": prefill_s, "first_token_s": first, "decode_step_s": step,
                "pull_s": first - step}

    out: dict = {}
    try:
        first = await handoff(64)  # the first pull between two engines pays the NIXL handshake
        out["first_handoff"] = first
        await handoff(64)
        points = []
        for n in HANDOFF_TOKENS[: args.limit or None]:
            runs = [await handoff(n) for _ in range(REPEATS)]
            point = {k: statistics.median(r[k] for r in runs) for k in ("prefill_s", "first_token_s", "decode_step_s",
                                                                          "pull_s")}
            points.append({"tokens": n, **point, "runs": runs})
            print(f"hand-off {n:5d} tokens: prefill {point['prefill_s'] * 1000:7.1f} ms, first token "
                  f"{point['first_token_s'] * 1000:7.1f} ms after submit, decode step "
                  f"{point['decode_step_s'] * 1000:5.1f} ms, pull {point['pull_s'] * 1000:6.1f} ms", flush=True)
        out["points"] = points
        neighbour = []
        await ask("busy", _BusyBatch(vocab, args.seed))
        for n in NEIGHBOUR_TOKENS[: args.limit or None]:
            busy = [await _timed_prefill(engine, prompts.make(n)) for _ in range(REPEATS)]
            neighbour.append({"tokens": n, "busy_s": statistics.median(busy), "busy_runs": busy})
        await ask("idle")
        for row in neighbour:
            idle = [await _timed_prefill(engine, prompts.make(row["tokens"])) for _ in range(REPEATS)]
            row.update(idle_s=statistics.median(idle), idle_runs=idle)
            print(f"prefill {row['tokens']:5d} tokens: {row['idle_s'] * 1000:7.1f} ms with the decode engine idle, "
                  f"{row['busy_s'] * 1000:7.1f} ms while it decodes {NEIGHBOUR_BATCH[0]} sequences", flush=True)
        out["neighbour"] = neighbour
    finally:
        await engine.shutdown()
        parent.send(("stop", None))
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    latency, bandwidth = fit_pull(out["points"], kv_bytes_per_token)
    slowdown = statistics.median(r["busy_s"] / r["idle_s"] for r in out["neighbour"]) if out["neighbour"] else None
    return {
        "kv_transfer": {"latency_s": latency, "bytes_per_s": bandwidth,
                        "source": "measured by `skyline profile --handoff`: decode engine submit with a KV handle -> "
                                  "first token, minus one decode step (two engines, NIXL)"},
        "handoff": {"measured": datetime.now(UTC).isoformat(timespec="seconds"),
                    "command": "skyline profile " + " ".join(args.argv),
                    "prefill_cpu_bind": args.cpu_bind, "decode_cpu_bind": args.decode_cpu_bind,
                    "decode_startup_s": round(decode_start, 1), "output_tokens": HANDOFF_OUTPUT,
                    "first_handoff": out["first_handoff"], "points": out["points"],
                    "neighbour": out["neighbour"], "neighbour_batch": list(NEIGHBOUR_BATCH),
                    "neighbour_slowdown": slowdown},
    }


async def _timed_prefill(engine, req) -> float:
    t0 = time.perf_counter()
    await engine.prefill(req)
    return time.perf_counter() - t0
