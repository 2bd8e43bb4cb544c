"""The fleet's LoRA adapters: one registry in Redis, as `vllm serve` keeps one in its process.

`vllm serve --enable-lora --lora-modules name=path` serves adapters from its start, and
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` change them at run time. Skyline's fleet
has many engines and gateways, so the set of adapters lives in Redis (`Keys.adapters`, a hash by
name): a worker started with `--lora-modules` registers them (`register_static`), a gateway's load
route adds one (`register`) and its unload route removes one (`unregister`). Every gateway serves
what the registry holds (its `/v1/models`, a request naming an adapter as its `model`), and every
worker's engine may load any of them: a request carries its adapter (`messages.AdapterRef`), and the
engine loads it on first use into one of its `max_loras` slots. A worker that joins later reads the
registry like the others; a gateway restarted knows every adapter at once.

Each load gets a new fleet-wide id (`Keys.adapter_ids`, vLLM's `lora_int_id`): an engine keeps an
adapter's weights under its id, so an adapter unloaded and loaded again (perhaps from new weights)
is never served with the weights an engine kept from before; workers remove from their engines the
ids the registry no longer holds (workers/adapters.py).

A path is read where the engines run, never by the gateway: a gateway on another host than the
workers need not see it. So the load route asks one worker of the base model that runs LoRA to check
it as its engine would load it (`ask_check` -> `take_check` / `answer_check`), and answers as
`vllm serve` answers a load its engine refused: nothing there is vLLM's 404, an adapter the engine
cannot take (a rank over --max-lora-rank, say) its 500 with the reason. One worker checks: workers of
one model are expected to see the same paths (one image, or storage every host mounts alike).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis

from skyline.core.keys import Keys
from skyline.core.messages import AdapterRef


@dataclass(frozen=True)
class Adapter:
    """One adapter of the registry."""

    name: str  # what clients send as `model`
    path: str  # a PEFT adapter folder (adapter_config.json + weights), readable where the engines run
    lora_id: int  # fleet-wide, new at each load (vLLM's lora_int_id)
    base_model: str  # the served model it adapts (its parent in /v1/models)
    loaded_ms: int = 0  # when it was loaded (Unix ms)
    static: bool = False  # from a worker's --lora-modules

    def ref(self) -> AdapterRef:
        return AdapterRef(self.name, self.lora_id, self.path)

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> Adapter:
        d = json.loads(raw)
        return cls(str(d["name"]), str(d["path"]), int(d["lora_id"]), str(d.get("base_model", "")),
                   int(d.get("loaded_ms", 0)), bool(d.get("static", False)))


async def read_all(r: aioredis.Redis, keys: Keys) -> dict[str, Adapter]:
    """Every registered adapter, by name."""
    out: dict[str, Adapter] = {}
    for name, raw in (await r.hgetall(keys.adapters)).items():
        try:
            a = Adapter.decode(raw)
        except (ValueError, KeyError, TypeError):
            continue  # not ours to read (written by hand?): ignored, never served
        out[a.name] = a
    return out


async def register(r: aioredis.Redis, keys: Keys, name: str, path: str, base_model: str,
                   static: bool = False) -> Adapter:
    """Add (or replace) adapter `name` with a new fleet-wide id."""
    lora_id = int(await r.incr(keys.adapter_ids))
    a = Adapter(name, path, lora_id, base_model, int(time.time() * 1000), static)
    await r.hset(keys.adapters, name, a.encode())
    return a


async def unregister(r: aioredis.Redis, keys: Keys, name: str) -> bool:
    """Remove adapter `name`; False when the registry did not hold it."""
    return bool(await r.hdel(keys.adapters, name))


async def register_static(r: aioredis.Redis, keys: Keys, modules: list[Any], base_model: str) -> list[Adapter]:
    """A worker's `--lora-modules` (vLLM's LoRAModulePath each): registered unless the registry already
    holds the name with the same path (another worker of the fleet registered it: the same adapter,
    the same id, so no engine reloads it). A name registered with another path is left as it is, with
    the reason returned by `conflicts`."""
    have = await read_all(r, keys)
    out = []
    for m in modules:
        known = have.get(m.name)
        if known is not None:
            out.append(known)
            continue
        # HSETNX through a fresh id: two workers starting together register one of them.
        a = Adapter(m.name, m.path, int(await r.incr(keys.adapter_ids)), m.base_model_name or base_model,
                    int(time.time() * 1000), True)
        if not await r.hsetnx(keys.adapters, m.name, a.encode()):
            raw = await r.hget(keys.adapters, m.name)
            a = Adapter.decode(raw) if raw else a
        out.append(a)
    return out


def conflicts(modules: list[Any], registered: list[Adapter]) -> list[str]:
    """Why some of a worker's --lora-modules are not what the fleet serves under their names."""
    by_name = {a.name: a for a in registered}
    return [f"--lora-modules {m.name}={m.path}: the fleet already serves {m.name!r} from {by_name[m.name].path} "
            "(unload it first to change it)" for m in modules
            if m.name in by_name and by_name[m.name].path != m.path]


# -- checking a path where the engines run (the module docstring) ------------------------------------

CHECK_TTL_S = 30  # a check's answer, and a queue of checks no worker reads, expire after this


@dataclass(frozen=True)
class Check:
    """One gateway's question: can an engine load an adapter from `path`?"""

    path: str
    reply: str  # the key its answer goes to
    until_ms: int  # the gateway stops waiting then: a worker that takes it later skips it


@dataclass(frozen=True)
class CheckResult:
    worker: str  # the worker that read the path
    problem: str = ""  # "" = its engine can load the adapter
    missing: bool = False  # nothing at the path (vLLM's LoRAAdapterNotFoundError)


async def ask_check(r: aioredis.Redis, keys: Keys, path: str, timeout_s: float) -> CheckResult | None:
    """Ask a worker of `keys`' model to check `path`; None when none answered within `timeout_s`."""
    check = Check(path, keys.adapter_check_reply(uuid.uuid4().hex), int((time.time() + timeout_s) * 1000))
    pipe = r.pipeline(transaction=False)
    pipe.rpush(keys.adapter_checks, json.dumps(asdict(check)))
    pipe.expire(keys.adapter_checks, CHECK_TTL_S)
    await pipe.execute()
    got = await r.blpop([check.reply], timeout=timeout_s)
    if got is None:
        return None
    d = json.loads(got[1])
    return CheckResult(str(d["worker"]), str(d.get("problem", "")), bool(d.get("missing", False)))


async def take_check(r: aioredis.Redis, keys: Keys, wait_s: float) -> Check | None:
    """The next check still awaited (a worker's side), waiting up to `wait_s` for one; None: none."""
    got = await r.blpop([keys.adapter_checks], timeout=wait_s)
    if got is None:
        return None
    try:
        d = json.loads(got[1])
        check = Check(str(d["path"]), str(d["reply"]), int(d["until_ms"]))
    except (ValueError, KeyError, TypeError):
        return None  # not ours to read
    return check if check.until_ms > time.time() * 1000 else None


async def answer_check(r: aioredis.Redis, check: Check, result: CheckResult) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.rpush(check.reply, json.dumps(asdict(result)))
    pipe.expire(check.reply, CHECK_TTL_S)
    await pipe.execute()


def config_problem(path: str) -> tuple[str, bool]:
    """(why an adapter cannot be loaded from `path`, whether nothing is there); ("", False) when its
    adapter_config.json reads as a PEFT config. What an engine without vLLM's own check (the sim) uses."""
    config = os.path.join(os.path.expanduser(path), "adapter_config.json")
    try:
        with open(config, encoding="utf-8") as f:
            d = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return f"no adapter_config.json at {path}", True
    except (OSError, ValueError) as exc:
        return f"{config} cannot be read as JSON: {exc}", False
    return ("", False) if isinstance(d, dict) else (f"{config} is not a JSON object", False)
