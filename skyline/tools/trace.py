"""`skyline trace REQUEST_ID`: a request's timeline as a readable waterfall.

Each row is one event at its offset from the first event; the bar spans the
time since the previous event, so the long bars are where the request
waited. Below, the phases a reader asks about (queueing, prefill, hand-off,
KV transfer, decode) with their durations and the workers that ran them.
Rendering is pure (`render`); `main` reads Redis.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from skyline.core import redisconn
from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.core.timeline import TimelineEvent, phase_durations, read_timeline

BAR_WIDTH = 24

def _fields(fields: dict, t0: int) -> str:
    # Absolute times (deadline_ms) read better relative to the first event, like the rows.
    return " ".join(f"{k}=+{v - t0:,.0f}" if k == "deadline_ms" and isinstance(v, (int, float)) else f"{k}={_short(v)}"
                    for k, v in fields.items())


def _short(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.1f}"
    text = str(v)
    return text if len(text) <= 40 else text[:37] + "..."


def render(request_id: str, events: list[TimelineEvent]) -> str:
    """The waterfall of one request's events (already in time order)."""
    if not events:
        return (f"no timeline for {request_id}: unknown id, expired (observability.timeline_ttl_s), "
                "or recorded under another key prefix")
    t0 = events[0].t_ms
    span = max(1, events[-1].t_ms - t0)
    who_w = min(28, max(len(e.who) for e in events))
    lines = [f"request {request_id}: {len(events)} events over {span:,.0f} ms",
             f"{'+ms':>8} {'took':>7}  {'':{BAR_WIDTH}}  {'event':<20} {'who':<{who_w}}  details"]
    prev = t0
    for e in events:
        a = round((prev - t0) / span * BAR_WIDTH)
        b = max(a + 1, round((e.t_ms - t0) / span * BAR_WIDTH)) if e.t_ms > prev else a + 1
        b = min(b, BAR_WIDTH)
        a = min(a, b - 1)
        bar = "·" * a + "█" * (b - a) + "·" * (BAR_WIDTH - b)
        lines.append(f"{e.t_ms - t0:>8,.0f} {e.t_ms - prev:>7,.0f}  {bar}  {e.event:<20} {e.who[:who_w]:<{who_w}}  "
                     f"{_fields(e.fields, t0)}".rstrip())
        prev = e.t_ms
    phases = phase_durations(events)
    if phases:
        lines += ["", "phases:"]
        for p in phases:
            times = f" ({p['count']} attempts)" if p["count"] > 1 else ""
            lines.append(f"  {p['phase']:<26} {p['ms']:>8,.0f} ms{times}  {', '.join(p['who'])}")
    return "\n".join(lines)


async def fetch(cfg: SkylineConfig, request_id: str) -> list[TimelineEvent]:
    r = redisconn.connect(cfg.redis)
    try:
        return await read_timeline(r, Keys(cfg.key_prefix), request_id)
    finally:
        await r.aclose()


def main(cfg: SkylineConfig, request_id: str, as_json: bool) -> int:
    events = asyncio.run(fetch(cfg, request_id))
    if as_json:
        print(json.dumps({"request_id": request_id, "events": [asdict(e) for e in events],
                          "phases": phase_durations(events)}, indent=2))
    else:
        print(render(request_id, events))
    return 0 if events else 1
