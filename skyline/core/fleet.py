"""Worker registry: heartbeats written by workers, read by the gateway and `skyline status`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from skyline.core.keys import Keys


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    engine: str
    model: str
    host: str
    pid: int
    running: int
    waiting: int
    kv_usage: float
    started: float
    last_seen: float  # Unix seconds of the last heartbeat
    running_tokens: int = 0  # prompt tokens this prefill worker holds (shown by `skyline status`)
    tokens_per_s: float = 0.0  # measured prefill throughput (0 = not measured yet)
    left_tokens: int = 0  # of its prompts' tokens, those its engine had left to compute at last_seen
    computes_long: int = 0  # elastic: 1 while long prompts gather on it (scheduler/claiming.py computes_long)
    # elastic: prompt tokens it claimed in the last elastic.MIX_WINDOW_S, of long prompts (the prefill
    # streams') and of short ones (the colocated route's): the fleet's phase mix (scheduler/elastic.py)
    long_tokens: int = 0
    short_tokens: int = 0
    address: str = ""  # where other hosts reach this worker (worker.advertise_host)
    metrics_port: int = 0  # its HTTP endpoint: /metrics, /ready, /health (0 = none)
    nixl_port: int = 0  # its engine's NIXL side channel (0 = no KV transfer)
    max_running: int = 0  # the most requests it holds at once (its placement counts as overloaded there)
    cache_block_size: int = 0  # its engine's prefix-cache block size; 0 = no cache view (placement skips it)
    kv_watermark: float = 0.0  # KV usage from which it claims nothing (decode workers; 0 = no such rule)
    # The model it serves, as the gateway needs it to serve that model too (gateway/models.py): `model`
    # is the served name clients send; its queues' keyspace ("" = the default model's plain keys,
    # keys.keyspace_of); the folder or hub id its engine loaded (the tokenizer and chat template the
    # gateway renders with; "" = the sim engine's byte tokenizer) and its context length.
    keyspace: str = ""
    model_path: str = ""
    max_model_len: int = 0
    # LoRA (skyline/core/adapters.py): the adapters its engine holds (names, comma-separated), how many it
    # runs at once (vLLM's max_loras; 0 = LoRA off), what loading one took it (ms, 0 = not measured) and
    # how many loads it made since it started (what `skyline bench run --workload lora` counts).
    adapters: str = ""
    lora_slots: int = 0
    adapter_load_ms: float = 0.0
    adapter_loads: int = 0

    def held_adapters(self) -> frozenset[str]:
        return frozenset(a for a in self.adapters.split(",") if a)


async def heartbeat(r: aioredis.Redis, keys: Keys, info: WorkerInfo, ttl_s: float) -> None:
    """Announce a worker for `ttl_s`. The hash carries the load numbers; the
    zset gives readers the list of workers without a SCAN (which would need
    one call per shard in Redis Cluster)."""
    now = time.time()
    info.last_seen = now
    pipe = r.pipeline(transaction=False)
    ttl = max(1, int(ttl_s + 0.999))
    pipe.hset(keys.worker(info.worker_id), mapping={k: str(v) for k, v in info.__dict__.items()})
    pipe.expire(keys.worker(info.worker_id), ttl)
    pipe.zadd(keys.workers, {info.worker_id: now})
    pipe.expire(keys.kv_cache(info.worker_id), ttl)  # its cache view lives as long
    await pipe.execute()


async def deregister(r: aioredis.Redis, keys: Keys, worker_id: str) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.delete(keys.worker(worker_id))
    pipe.delete(keys.kv_cache(worker_id))  # its engine's cache goes with it
    pipe.zrem(keys.workers, worker_id)
    await pipe.execute()


async def list_workers(r: aioredis.Redis, keys: Keys, liveness_s: float) -> list[WorkerInfo]:
    """Workers whose last heartbeat is younger than `liveness_s`. Members older
    than a minute are pruned from the zset (their hashes already expired)."""
    now = time.time()
    await r.zremrangebyscore(keys.workers, "-inf", now - 60)
    ids = [i.decode() if isinstance(i, bytes) else i for i in await r.zrangebyscore(keys.workers, now - liveness_s, "+inf")]
    if not ids:
        return []
    pipe = r.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(keys.worker(worker_id))
    return [_info_of(raw) for raw in await pipe.execute() if raw]


async def read_worker(r: aioredis.Redis, keys: Keys, worker_id: str) -> WorkerInfo | None:
    """One worker's newest heartbeat (None: gone), for a decision that must not wait for the next beat's
    `list_workers`."""
    raw = await r.hgetall(keys.worker(worker_id))
    return _info_of(raw) if raw else None


def _info_of(raw: dict) -> WorkerInfo:
    d = {k.decode(): v.decode() for k, v in raw.items()}
    return WorkerInfo(
        worker_id=d["worker_id"], role=d["role"], engine=d["engine"], model=d["model"], host=d["host"],
        pid=int(d["pid"]), running=int(d["running"]), waiting=int(d["waiting"]),
        kv_usage=float(d["kv_usage"]), started=float(d["started"]), last_seen=float(d["last_seen"]),
        running_tokens=int(d.get("running_tokens", 0)), tokens_per_s=float(d.get("tokens_per_s", 0.0)),
        left_tokens=int(d.get("left_tokens", d.get("running_tokens", 0))), computes_long=int(d.get("computes_long", 0)),
        long_tokens=int(d.get("long_tokens", 0)), short_tokens=int(d.get("short_tokens", 0)),
        address=d.get("address", ""), metrics_port=int(d.get("metrics_port", 0)),
        nixl_port=int(d.get("nixl_port", 0)), max_running=int(d.get("max_running", 0)),
        cache_block_size=int(d.get("cache_block_size", 0)), kv_watermark=float(d.get("kv_watermark", 0.0)),
        adapters=d.get("adapters", ""), lora_slots=int(d.get("lora_slots", 0)),
        adapter_load_ms=float(d.get("adapter_load_ms", 0.0)), adapter_loads=int(d.get("adapter_loads", 0)),
        keyspace=d.get("keyspace", ""), model_path=d.get("model_path", ""),
        max_model_len=int(d.get("max_model_len", 0)),
    )
