"""`skyline status`: the queues, the fleet and recent SLO attainment as Redis sees them.

A live terminal view (redrawn every second, fits 100 columns), `--once` for
scripts, `--json` for tools. A fleet of several models shows each model's
streams (and workers) under its served name. SLO attainment comes from the per-minute
counters every gateway writes (skyline/core/slo_record.py).

The same numbers are available by hand (README "Looking at the queues", docs/operations.md):
  XINFO STREAM / XINFO GROUPS skyline:{prefill}:interactive   length, pending, lag
  XPENDING skyline:{decode}:standard decode                    claimed but not acked
  ZRANGE skyline:workers 0 -1 WITHSCORES; HGETALL skyline:worker:<id>
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

from skyline.core import redisconn
from skyline.core.config import SkylineConfig
from skyline.core.fleet import list_workers
from skyline.core.keys import Keys
from skyline.core.queues import fleet_models, read_model_streams
from skyline.core.slo_record import attainment, read_minutes


ATTAINMENT_WINDOWS = (1, 5, 15)  # minutes shown by `skyline status`
WIDTH = 100  # the terminal view fits this many columns


async def snapshot(r, cfg: SkylineConfig) -> dict:
    """Streams, workers and recent SLO attainment, as one JSON-able dict."""
    keys = Keys(cfg.key_prefix)
    now = time.time()
    workers = await list_workers(r, keys, liveness_s=cfg.gateway.worker_liveness_s)
    # Every model's queues (skyline/core/keys.py): the default model's plain keys, and each live model's.
    models = fleet_models(workers, cfg.default_model)
    streams = await read_model_streams(r, keys, cfg.tier_names, models)
    minutes = await read_minutes(r, keys, int(now * 1000), max(ATTAINMENT_WINDOWS))
    slo = {f"{w}m": {t: attainment(minutes[-w:], t) for t in (*cfg.tier_names, None)} for w in ATTAINMENT_WINDOWS}
    # Each model's own, once the fleet serves or served several in the window (its requests' verdicts, all
    # tiers and by tier; a model whose workers left keeps its record): they add up to the fleet's.
    named = sorted({*models.values(), *(name for m in minutes for name in m["models"])})
    by_model = {name: {f"{w}m": {t or "all": attainment(minutes[-w:], t, name) for t in (*cfg.tier_names, None)}
                       for w in ATTAINMENT_WINDOWS} for name in named} if len(named) > 1 else {}
    return {"redis": redisconn.describe(cfg.redis), "time": now, "streams": streams,
            "models": {name: {"keyspace": keyspace, "workers": sum(w.keyspace == keyspace for w in workers)}
                       for keyspace, name in models.items()},
            "workers": [asdict(w) for w in workers], "max_running": cfg.worker.max_running,
            "slo_attainment": {w: {t or "all": a for t, a in by_tier.items()} for w, by_tier in slo.items()},
            "slo_attainment_by_model": by_model}


async def collect(cfg: SkylineConfig) -> dict:
    r = redisconn.connect(cfg.redis)
    try:
        return await snapshot(r, cfg)
    finally:
        await r.aclose()


def _attained(a: dict) -> str:
    if not a["done"]:
        return "-"
    return f"{100 * a['met'] / a['done']:5.1f}% {a['met']:>5}/{a['done']:<5}"


def render(snap: dict) -> str:
    """The terminal view (fits WIDTH columns)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snap["time"]))
    lines = [f"skyline status   {snap['redis'][:60]}   {stamp}", ""]
    windows = list(snap.get("slo_attainment", {}))
    if windows:
        lines.append(f"{'SLO attainment (met/answered)':<30}" + "".join(f"{'last ' + w[:-1] + ' min':<23}"
                                                                      for w in windows))
        for tier in snap["slo_attainment"][windows[0]]:
            lines.append(f"  {tier:<28}" + "".join(f"{_attained(snap['slo_attainment'][w][tier]):<23}"
                                                  for w in windows))
        for model, by_window in snap.get("slo_attainment_by_model", {}).items():  # all tiers, per model
            lines.append(f"  {('model ' + model)[:28]:<28}" + "".join(f"{_attained(by_window[w]['all']):<23}"
                                                                     for w in windows))
        lines.append("")
    lines.append(f"{'STREAM':<28} {'waiting':>8} {'claimed':>8} {'backlog tokens':>15} {'length':>9} "
                 f"{'consumers':>10}")
    several = len(snap.get("models", {})) > 1  # then each stream and worker names its model
    for s in snap["streams"]:
        name = (f"{s['model']}/" if several else "") + f"{s['stage']}:{s['tier']}"
        lines.append(f"{name[-28:]:<28} {s.get('waiting', 0):>8} {s['pending']:>8} "
                     f"{s.get('backlog_tokens', 0):>15,} {s['length']:>9} {s['consumers']:>10}")
    lines += ["", f"{'WORKER':<28} {'role':<8} {'engine':<6} {'running':>7} {'load':<12} {'waiting':>7} "
                  f"{'kv':>5} {'tok/s':>7} {'seen':>6}"]
    now, cap = snap["time"], max(1, snap.get("max_running", 1))
    for w in sorted(snap["workers"], key=lambda w: (w["role"], w["worker_id"])):
        filled = min(10, round(10 * w["running"] / cap))
        bar = "[" + "#" * filled + "." * (10 - filled) + "]"
        rate = f"{w.get('tokens_per_s', 0):,.0f}" if w["role"] == "prefill" else "-"
        wid = (f"{w['model']}/" if several else "") + w["worker_id"]
        lines.append(f"{wid[:28]:<28} {w['role']:<8} {w['engine']:<6} {w['running']:>7} {bar:<12} "
                     f"{w['waiting']:>7} {w['kv_usage'] * 100:>4.0f}% {rate:>7} {now - w['last_seen']:>5.1f}s")
    if not snap["workers"]:
        lines.append("(no live workers: start one with `skyline worker elastic|prefill|decode`)")
    return "\n".join(line[:WIDTH].rstrip() for line in lines)


def main(cfg: SkylineConfig, as_json: bool, once: bool, interval_s: float = 1.0) -> None:
    """Print once (`once`) or redraw every `interval_s` until Ctrl-C."""
    try:
        asyncio.run(_loop(cfg, as_json, once, interval_s))
    except KeyboardInterrupt:
        pass


async def _loop(cfg: SkylineConfig, as_json: bool, once: bool, interval_s: float) -> None:
    r = redisconn.connect(cfg.redis)
    try:
        while True:
            snap = await snapshot(r, cfg)
            text = json.dumps(snap, indent=2) if as_json else render(snap)
            if once:
                print(text)
                return
            print("\033[2J\033[H" + text + "\n\n(refreshing every " + f"{interval_s:g} s; Ctrl-C quits)", flush=True)
            await asyncio.sleep(interval_s)
    finally:
        await r.aclose()

