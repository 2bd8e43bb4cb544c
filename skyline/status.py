"""`skyline status`: the queues and the fleet as Redis sees them.

The same numbers are available by hand (see the README):
  XINFO STREAM / XINFO GROUPS skyline:{prefill}:interactive   length, pending, lag
  XPENDING skyline:{decode}:standard decode                    claimed but not acked
  ZRANGE skyline:workers 0 -1 WITHSCORES; HGETALL skyline:worker:<id>
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from skyline.config import SkylineConfig
from skyline.fleet import list_workers
from skyline.keys import Keys


@dataclass
class StreamStatus:
    stage: str
    tier: str
    key: str
    length: int
    pending: int
    lag: int | None
    consumers: int


async def collect(cfg: SkylineConfig) -> dict:
    keys = Keys(cfg.key_prefix)
    r = aioredis.from_url(cfg.redis.url)
    try:
        streams = []
        for stage, tier, key in keys.all_streams(cfg.tier_names):
            length = await r.xlen(key)
            pending = consumers = 0
            lag: int | None = None
            try:
                for g in await r.xinfo_groups(key):
                    if _s(g["name"]) == Keys.group(stage):
                        pending, consumers, lag = int(g["pending"]), int(g["consumers"]), g.get("lag")
            except ResponseError:
                pass  # stream not created yet: no worker of this stage has started
            streams.append(StreamStatus(stage, tier, key, length, pending, lag, consumers))
        workers = await list_workers(r, keys, liveness_s=cfg.gateway.worker_liveness_s)
        return {"redis": cfg.redis.url, "time": time.time(), "streams": [asdict(s) for s in streams],
                "workers": [asdict(w) for w in workers]}
    finally:
        await r.aclose()


def render(snapshot: dict) -> str:
    lines = [f"redis {snapshot['redis']}", "", f"{'stream':<34} {'length':>7} {'pending':>8} {'lag':>6} {'consumers':>9}"]
    for s in snapshot["streams"]:
        lag = "-" if s["lag"] is None else str(s["lag"])
        lines.append(f"{s['key']:<34} {s['length']:>7} {s['pending']:>8} {lag:>6} {s['consumers']:>9}")
    lines += ["", f"{'worker':<34} {'role':<8} {'engine':<6} {'running':>7} {'waiting':>7} {'kv':>5} {'heartbeat':>10}"]
    now = snapshot["time"]
    for w in sorted(snapshot["workers"], key=lambda w: (w["role"], w["worker_id"])):
        lines.append(
            f"{w['worker_id'][:34]:<34} {w['role']:<8} {w['engine']:<6} {w['running']:>7} {w['waiting']:>7} "
            f"{w['kv_usage'] * 100:>4.0f}% {now - w['last_seen']:>8.1f}s ago"
        )
    if not snapshot["workers"]:
        lines.append("(no live workers: start one with `skyline worker prefill|decode`)")
    return "\n".join(lines)


def main(cfg: SkylineConfig, as_json: bool, once: bool) -> None:
    while True:
        snap = asyncio.run(collect(cfg))
        text = json.dumps(snap, indent=2) if as_json else render(snap)
        if once:
            print(text)
            return
        print("\033[2J\033[H" + text, flush=True)
        time.sleep(2)


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
