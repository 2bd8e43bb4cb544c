"""The multi-LoRA workload (`skyline bench run --workload lora`): its adapters, which one each request
names, and the adapter loads each system made.

The requests are the mixed workload's (chat in the interactive tier, RAG in the standard one); each
names one of `adapters` LoRA adapters as its `model`, drawn with Zipf popularity (the i-th most
popular adapter with weight 1 / i**s), seeded, so every system gets the same adapter for the same
request. The adapters are made at run time from the default model with `peft` (rank 8 on q_proj and
v_proj, seeded non-zero weights that change the greedy answer: nothing from a hub), as the LoRA
tests make theirs; the sim engine's are folders with a config only (it reads no weights).

Every engine has `MAX_LORAS` adapter slots (vLLM's --max-loras; its CPU cache, --max-cpu-loras, is
as large by default): with more adapters than slots, an engine evicts one to load another, and a
placement that keeps an adapter's requests on the engines holding it loads less.

Adapter loads are counted outside the systems where they read weights: every load of a real engine,
plain vLLM's or a Skyline worker's, opens the adapter's `adapter_model.safetensors` (vLLM's
LoRAModel.from_local_checkpoint), so `WeightOpens` counts those opens with inotify, the same count for
every system. The sim engine opens nothing; its loads are what its workers advertise
(`adapter_loads` on their heartbeats: `fleet_loads`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import random
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path

import redis

from skyline.core.keys import Keys
from skyline.tools.bench.workload import BenchRequest

ADAPTER_RANK = 8  # every adapter's rank, and the engines' --max-lora-rank
MAX_LORAS = 2  # adapter slots per engine, every system alike
WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    adapters: int = 8  # how many adapters the requests name
    zipf: float = 1.0  # the popularity's exponent s (0 = every adapter alike)


def adapter_names(n: int) -> list[str]:
    """The adapters' names, most popular first."""
    return [f"lora-{i}" for i in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    """The popularity of n adapters, most popular first, summing to 1."""
    raw = [1.0 / (i + 1) ** s for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def assign(requests: list[BenchRequest], spec: LoraSpec, seed: int, stream: str) -> list[BenchRequest]:
    """`requests` each naming an adapter, drawn by popularity from a random stream of its own (so the
    prompts, lengths and send times stay the mixed workload's)."""
    rng = random.Random(f"{seed}:adapters:{stream}")
    names, weights = adapter_names(spec.adapters), zipf_weights(spec.adapters, spec.zipf)
    return [replace(r, adapter=rng.choices(names, weights)[0]) for r in requests]


# -- the adapters ---------------------------------------------------------------------------------


def make_adapters(model_dir: str, out_dirs: list[str], seed: int = 1234) -> list[str]:
    """PEFT LoRA adapters of the model at `model_dir`, one per folder: rank 8 on q_proj and v_proj,
    weights drawn from N(0, 0.1) with seed `seed + i` (B non-zero and large enough to change the greedy
    answer). The base model is loaded once for all of them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=ADAPTER_RANK, lora_alpha=2 * ADAPTER_RANK,
                                            target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    for i, out_dir in enumerate(out_dirs):
        torch.manual_seed(seed + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.1)
        model.save_pretrained(out_dir)
    return out_dirs


def write_adapters(folder: Path, spec: LoraSpec, engine: str) -> list[tuple[str, str]]:
    """(name, path) of the workload's adapters, made under `folder` (kept with the run's results)."""
    names = adapter_names(spec.adapters)
    paths = [str((folder / engine / name).resolve()) for name in names]
    if engine == "sim":
        for path in paths:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": ADAPTER_RANK}))
    else:
        from skyline.tools.model import resolve_model

        make_adapters(resolve_model("default"), paths)
    return list(zip(names, paths))


def engine_flags() -> list[str]:
    """The LoRA arguments of every vLLM engine of the benchmark (plain vLLM's and Skyline's workers')."""
    return ["--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(ADAPTER_RANK)]


# -- counting loads ---------------------------------------------------------------------------------

_IN_OPEN, _IN_NONBLOCK = 0x20, 0o4000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class WeightOpens:
    """Opens of the adapters' weight files, by any process (Linux inotify): one per adapter load."""

    def __init__(self, paths: list[str]):
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fd = self._libc.inotify_init1(_IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        for path in paths:
            if self._libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_OPEN) < 0:
                raise OSError(ctypes.get_errno(), f"cannot watch {path}")
        self.count = 0

    def read(self) -> int:
        """The opens so far (events read without waiting)."""
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return self.count
            at = 0
            while at < len(data):
                _wd, _mask, _cookie, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size:at + _EVENT.size + size].rstrip(b"\0")
                self.count += name == WEIGHTS.encode()
                at += _EVENT.size + size

    def close(self) -> None:
        os.close(self._fd)


def fleet_loads(redis_url: str, key_prefix: str, settle_s: float = 1.5) -> int:
    """The adapter loads a Skyline fleet's live workers advertise, after `settle_s` (a heartbeat) so the
    last loads are in."""
    time.sleep(settle_s)
    keys = Keys(key_prefix)
    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        ids = [i.decode() for i in r.zrangebyscore(keys.workers, time.time() - 60, "+inf")]
        return sum(int(r.hget(keys.worker(w), "adapter_loads") or 0) for w in ids)
    finally:
        r.close()
