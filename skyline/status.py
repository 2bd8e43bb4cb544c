"""`skyline status`: the queues, the fleet and recent SLO attainment as Redis sees them.

A live terminal view (redrawn every second, fits 100 columns), `--once` for
scripts, `--json` for tools. SLO attainment comes from the per-minute
counters every gateway writes (skyline/slo_record.py).

The same numbers are available by hand (README "Looking at the queues", docs/operations.md):
  XINFO STREAM / XINFO GROUPS skyline:{prefill}:interactive   length, pending, lag
  XPENDING skyline:{decode}:standard decode                    claimed but not acked
  ZRANGE skyline:workers 0 -1 WITHSCORES; HGETALL skyline:worker:<id>
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

from skyline import redisconn
from skyline.config import SkylineConfig
from skyline.fleet import list_workers
from skyline.keys import STAGES, Keys
from skyline.slo_record import attainment, read_minutes


@dataclass
class StreamStatus:
    stage: str
    tier: str
    key: str
    length: int
    pending: int
    lag: int | None
    consumers: int
    backlog_tokens: int = 0  # prompt tokens admitted and not yet prefilled (skyline:backlog)
    # Entries no worker has claimed yet: the queue depth. `length` counts acked entries too
    # (streams are only trimmed by MAXLEN), so it is no measure of waiting work.
    waiting: int = 0


# Redis < 7 reports no group lag; waiting entries are then counted with a bounded XRANGE
# (a deeper queue shows as this many).
WAITING_COUNT_CAP = 1000


async def read_streams(r, keys: Keys, tiers: tuple[str, ...]) -> list[StreamStatus]:
    """Length, pending, lag and consumers of every work stream, and the prefill backlog
    in tokens: one pipelined round trip (the gateway's /metrics and /dashboard call it
    on every scrape/poll). A tier's retry lane (work returned to the queue) is counted
    with its stream: one row per stage and tier."""
    streams = [(stage, tier, key) for stage in STAGES for tier, key in keys.lanes(stage, tiers)]
    pipe = r.pipeline(transaction=False)
    for _stage, _tier, key in streams:
        pipe.xlen(key)
        pipe.xinfo_groups(key)
    pipe.hgetall(keys.backlog)
    results = await pipe.execute(raise_on_error=False)
    backlog = {_s(k): int(v) for k, v in (results[-1] or {}).items()} if isinstance(results[-1], dict) else {}
    out, uncounted = [], []
    for i, (stage, tier, key) in enumerate(streams):
        length, groups = results[2 * i], results[2 * i + 1]
        pending = consumers = 0
        lag: int | None = None
        last_delivered = None
        if isinstance(groups, list):  # an error (stream not created yet: no worker of this stage started)
            for g in groups:
                if _s(g["name"]) == Keys.group(stage):
                    pending, consumers, lag = int(g["pending"]), int(g["consumers"]), g.get("lag")
                    last_delivered = _s(g["last-delivered-id"])
        st = StreamStatus(stage, tier, key, length if isinstance(length, int) else 0, pending, lag, consumers,
                          max(0, backlog.get(Keys.backlog_field(stage, tier), 0)))
        if lag is not None:
            st.waiting = int(lag)
        elif last_delivered is not None and st.length:
            uncounted.append((st, last_delivered))
        out.append(st)
    if uncounted:
        pipe = r.pipeline(transaction=False)
        for st, last in uncounted:
            pipe.xrange(st.key, f"({last}", "+", count=WAITING_COUNT_CAP)
        for (st, _), entries in zip(uncounted, await pipe.execute(raise_on_error=False)):
            st.waiting = len(entries) if isinstance(entries, list) else 0
    rows = {(st.stage, st.tier): st for st in out if st.key == keys.stream(st.stage, st.tier)}
    for st in out:
        row = rows[(st.stage, st.tier)]
        if st is not row:  # the tier's retry lane
            row.length += st.length
            row.pending += st.pending
            row.waiting += st.waiting
            row.consumers = max(row.consumers, st.consumers)
            if row.lag is not None and st.lag is not None:
                row.lag += st.lag
    return list(rows.values())


ATTAINMENT_WINDOWS = (1, 5, 15)  # minutes shown by `skyline status`
WIDTH = 100  # the terminal view fits this many columns


async def snapshot(r, cfg: SkylineConfig) -> dict:
    """Streams, workers and recent SLO attainment, as one JSON-able dict."""
    keys = Keys(cfg.key_prefix)
    now = time.time()
    streams = await read_streams(r, keys, cfg.tier_names)
    workers = await list_workers(r, keys, liveness_s=cfg.gateway.worker_liveness_s)
    minutes = await read_minutes(r, keys, int(now * 1000), max(ATTAINMENT_WINDOWS))
    slo = {f"{w}m": {t: attainment(minutes[-w:], t) for t in (*cfg.tier_names, None)} for w in ATTAINMENT_WINDOWS}
    return {"redis": redisconn.describe(cfg.redis), "time": now, "streams": [asdict(s) for s in streams],
            "workers": [asdict(w) for w in workers], "max_running": cfg.worker.max_running,
            "slo_attainment": {w: {t or "all": a for t, a in by_tier.items()} for w, by_tier in slo.items()}}


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
        lines.append("")
    lines.append(f"{'STREAM':<28} {'waiting':>8} {'claimed':>8} {'backlog tokens':>15} {'length':>9} "
                 f"{'consumers':>10}")
    for s in snap["streams"]:
        lines.append(f"{s['stage'] + ':' + s['tier']:<28} {s.get('waiting', 0):>8} {s['pending']:>8} "
                     f"{s.get('backlog_tokens', 0):>15,} {s['length']:>9} {s['consumers']:>10}")
    lines += ["", f"{'WORKER':<28} {'role':<8} {'engine':<6} {'running':>7} {'load':<12} {'waiting':>7} "
                  f"{'kv':>5} {'tok/s':>7} {'seen':>6}"]
    now, cap = snap["time"], max(1, snap.get("max_running", 1))
    for w in sorted(snap["workers"], key=lambda w: (w["role"], w["worker_id"])):
        filled = min(10, round(10 * w["running"] / cap))
        bar = "[" + "#" * filled + "." * (10 - filled) + "]"
        rate = f"{w.get('tokens_per_s', 0):,.0f}" if w["role"] == "prefill" else "-"
        lines.append(f"{w['worker_id'][:28]:<28} {w['role']:<8} {w['engine']:<6} {w['running']:>7} {bar:<12} "
                     f"{w['waiting']:>7} {w['kv_usage'] * 100:>4.0f}% {rate:>7} {now - w['last_seen']:>5.1f}s")
    if not snap["workers"]:
        lines.append("(no live workers: start one with `skyline worker prefill|decode`)")
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


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
