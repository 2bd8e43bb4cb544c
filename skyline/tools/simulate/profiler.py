"""`skyline profile`: measure a real engine and write a JSON performance profile.

The engine is built exactly as a worker builds it (`workers/main.build_engine`,
same EngineConfig: chunked-prefill step size, dtype, KV connector on or off,
core binding), so the profile describes the engines the fleet runs. Measured:

  prefill   time of one prompt of N tokens (max_tokens=1), N from one step to
            nearly the context; and k prompts submitted together (makespan);
  decode    step time for B running sequences of prompt length L, from the
            gaps between streamed tokens once every sequence is decoding;
  kv        bytes per token from the model's shape; transfer speed needs a
            second engine: the profile records the figure given on the command
            line and says where it came from, until `--handoff` measures it
            (`handoff.py`: two engines, decode submit -> first token) and
            writes the measurement into an existing profile.

Prompts are random token ids, fresh for every request, so the prefix cache
never shortens a prefill. The simulator (`perf_profile.py`) interpolates it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

PREFILL_TOKENS = (16, 32, 64, 128, 192, 256, 512, 1024, 1536, 1984)
PREFILL_BATCHES = ((2, 128), (4, 128), (8, 128), (4, 256), (2, 512))  # (prompts, tokens each)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_PROMPTS = (32, 256, 1024)
DECODE_MAX_CONTEXT = 8192  # B x L above this takes minutes to prefill on one core: skipped
DECODE_OUTPUT = 24
REPEATS = 3


class _Prompts:
    """Fresh random token ids for every prompt: no prefix-cache hits between measurements."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng, self.n = vocab, random.Random(seed), 0

    def make(self, tokens: int):
        from skyline.core.messages import SamplingSpec
        from skyline.workers.engines.base import EngineRequest

        self.n += 1
        ids = [self.rng.randrange(100, self.vocab - 1) for _ in range(tokens)]
        return EngineRequest(f"profile-{self.n}", ids, SamplingSpec(max_tokens=1, temperature=0.0, ignore_eos=True))


async def _prefill_once(engine, req, kv_transfer: bool) -> float:
    t0 = time.perf_counter()
    if kv_transfer:
        await engine.prefill(req)  # the prefill worker's path: max_tokens=1, KV kept for a pull
    else:
        async for _ in engine.generate(req, None):
            pass
    return time.perf_counter() - t0


async def _decode_run(engine, prompts: _Prompts, batch: int, prompt_tokens: int) -> float:
    """Median gap between streamed tokens while all `batch` sequences are decoding."""
    reqs = [prompts.make(prompt_tokens) for _ in range(batch)]
    for r in reqs:
        r.sampling.max_tokens = DECODE_OUTPUT
    times: list[list[float]] = [[] for _ in reqs]

    async def one(i: int) -> None:
        async for chunk in engine.generate(reqs[i], None):
            if chunk.token_ids:
                times[i].append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(batch)))
    all_decoding = max(t[0] for t in times)  # the last sequence's first token: from here on, pure decode steps
    gaps = [b - a for t in times for a, b in itertools.pairwise(t) if a >= all_decoding]
    return statistics.median(gaps) if gaps else float("nan")


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    width = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * width  # K and V, every layer


async def measure(args: argparse.Namespace) -> dict:
    from skyline.core.config import EngineConfig
    from skyline.tools.model import resolve_model
    from skyline.workers.main import build_engine

    model_dir = resolve_model(args.model)
    ec = EngineConfig(kind="vllm", model=args.model, cpu_bind=args.cpu_bind, kv_transfer=args.kv_transfer,
                      kv_cache_gib=args.kv_cache_gib)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    engine = build_engine(ec, model_dir)
    t0 = time.perf_counter()
    await engine.start()
    startup_s = time.perf_counter() - t0
    prompts = _Prompts(vocab, args.seed)
    out: dict = {"prefill": [], "decode": []}
    try:
        for _ in range(2):  # warm-up: first requests pay one-off costs
            await _prefill_once(engine, prompts.make(64), args.kv_transfer)
        for n in PREFILL_TOKENS[: args.limit or None]:
            runs = [await _prefill_once(engine, prompts.make(n), args.kv_transfer) for _ in range(REPEATS)]
            out["prefill"].append({"tokens": n, "seqs": 1, "seconds": statistics.median(runs), "runs": runs})
            print(f"prefill {n:5d} tokens: {statistics.median(runs) * 1000:8.1f} ms", flush=True)
        for k, n in PREFILL_BATCHES[: args.limit or None]:
            runs = []
            for _ in range(REPEATS):
                t = time.perf_counter()
                await asyncio.gather(*(_prefill_once(engine, prompts.make(n), args.kv_transfer) for _ in range(k)))
                runs.append(time.perf_counter() - t)
            out["prefill"].append({"tokens": k * n, "seqs": k, "seconds": statistics.median(runs), "runs": runs})
            print(f"prefill {k} x {n} tokens: {statistics.median(runs) * 1000:8.1f} ms", flush=True)
        for b in DECODE_BATCHES[: args.limit or None]:
            for n in DECODE_PROMPTS:
                if b * n > DECODE_MAX_CONTEXT:
                    continue
                step = await _decode_run(engine, prompts, b, n)
                ctx = b * (n + DECODE_OUTPUT // 2)  # mean total context over the measured steps
                out["decode"].append({"batch": b, "prompt_tokens": n, "context_tokens": ctx, "step_s": step})
                print(f"decode batch {b:3d} x {n:5d}-token prompts: {step * 1000:8.1f} ms/step", flush=True)
    finally:
        await engine.shutdown()
    import vllm

    kv_bpt = kv_bytes_per_token(model_dir, ec.dtype)
    return {
        "kind": "skyline-engine-profile",
        "version": 1,
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "skyline profile " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "engine": {"kind": "vllm", "vllm": vllm.__version__, "model": Path(model_dir).name, "dtype": ec.dtype,
                   "cpu_bind": args.cpu_bind, "kv_transfer": args.kv_transfer,
                   "max_num_batched_tokens": ec.max_num_batched_tokens, "kv_cache_gib": ec.kv_cache_gib,
                   "startup_s": round(startup_s, 1)},
        "gpus_per_engine": 0,  # a CPU engine: costs one host's cores, counted as one "device" in searches
        "max_step_tokens": ec.max_num_batched_tokens,
        "kv_bytes_per_token": kv_bpt,
        "kv_capacity_tokens": int(ec.kv_cache_gib * (1 << 30) // kv_bpt),
        "kv_transfer": {"latency_s": args.kv_latency_ms / 1000, "bytes_per_s": args.kv_bytes_per_s,
                        "source": args.kv_source},
        "prefill": out["prefill"],
        "decode": out["decode"],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' or a local HF folder")
    p.add_argument("--cpu-bind", default="0", help="cores of the engine (VLLM_CPU_OMP_THREADS_BIND), e.g. 0 or 0-1")
    p.add_argument("--no-kv-transfer", dest="kv_transfer", action="store_false",
                   help="no NIXL connector (how colocated engines run); default: loaded, as on prefill/decode workers")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--kv-latency-ms", type=float, default=0.0, help="KV transfer: fixed cost per pull (not measured)")
    # The bandwidth of a hand measurement between two CPU vLLM engines over NIXL (docs/request-flow.md,
    # "Where the time goes").
    p.add_argument("--kv-bytes-per-s", type=float, default=7.0e8, help="KV transfer bandwidth (not measured)")
    p.add_argument("--kv-source", default="hand measurement: ~12 ms for ~8.4 MB between two CPU engines over NIXL",
                   help="where the KV transfer figures come from (recorded in the profile)")
    p.add_argument("--handoff", action="store_true",
                   help="measure the hand-off between two engines (prefill on --cpu-bind, decode on "
                        "--decode-cpu-bind) and write it into the existing profile --out (kv_transfer, handoff)")
    p.add_argument("--decode-cpu-bind", default="1", help="with --handoff: cores of the decode engine")
    p.add_argument("--limit", type=int, default=0, help="measure only the first N points of each grid (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON file to write")


async def measure_handoff(args: argparse.Namespace) -> dict:
    from skyline.tools.model import resolve_model
    from skyline.tools.simulate import handoff

    model_dir = resolve_model(args.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    return await handoff.measure(args, _Prompts(vocab, args.seed), kv_bytes_per_token(model_dir, "float32"),
                                 model_dir, vocab)


def main(args: argparse.Namespace, argv: list[str]) -> None:
    args.argv = argv
    out = Path(args.out)
    if args.handoff:
        if not out.exists():
            raise SystemExit(f"--handoff adds to an existing profile: {out} does not exist (run skyline profile first)")
        profile = {**json.loads(out.read_text()), **asyncio.run(measure_handoff(args))}
        out.write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {out}")
        return
    profile = asyncio.run(measure(args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {out}")
