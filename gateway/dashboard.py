"""`GET /dashboard`: one self-contained live page; `GET /dashboard/data`: what it polls.

The page (dashboard.html next to this file) has no build step and fetches
nothing but this gateway's own JSON: its charts are drawn on <canvas> by a
few dozen lines of its own script. Every ~2 s it reads `/dashboard/data`:
the queues and workers now (queue depth over time accumulates in the
browser), per-minute SLO attainment (the `skyline:slo:<minute>` counters all
gateways write), TTFT/TPOT percentiles per minute and the slowest recent
requests (from `skyline:recent`). Clicking a slow request draws its timeline
from `/v1/requests/{id}/timeline`.

Who may look: with API keys on, `/dashboard/data` needs an operator key
(`gateway.operator_api_keys`): 401 without a key, 403 with a tenant's. The
page shows the whole fleet (every tenant's queues, latencies and request
ids), and splitting it per tenant would leave most of it (queues, workers)
either empty or someone else's, so it is the operators' tool. `/dashboard`
itself answers without a key: it is the page's code and no data (a browser
cannot send an Authorization header when it navigates), and it asks for the
key, keeps it in the tab's sessionStorage (never in a URL, where logs and
history would keep it) and sends it as `Authorization: Bearer` with every
fetch, timelines included (an operator key reads every timeline).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi.responses import HTMLResponse, JSONResponse
from redis.exceptions import RedisError
from starlette.requests import Request

from skyline.core.config import SkylineConfig
from skyline.core.keys import Keys
from skyline.core.queues import fleet_models, read_model_streams
from skyline.core.slo_record import attainment, by_minute, read_minutes, read_recent, slowest
from skyline.gateway.errors import ApiError
from skyline.gateway.tenants import Tenants

PAGE = Path(__file__).with_name("dashboard.html")
WINDOW_MINUTES = 15  # charts span this many minutes
SLOWEST = 10


async def dashboard_data(r: Any, fleet: Any, cfg: SkylineConfig, keys: Keys, now_ms: int) -> dict:
    """Everything the page shows, as one JSON-able dict."""
    # Every model's queues (its keyspace's), each row naming its model; the page names it once there are several.
    models = fleet_models(fleet.workers if fleet else [], cfg.default_model)
    streams, minutes, recent = await asyncio.gather(
        read_model_streams(r, keys, cfg.tier_names, models),
        read_minutes(r, keys, now_ms, WINDOW_MINUTES),
        read_recent(r, keys, cfg.observability.recent_requests),
    )
    last5 = minutes[-5:]
    latency = {m["minute"]: m for m in by_minute(recent, now_ms, WINDOW_MINUTES)}
    per_minute = []
    for m in minutes:
        row = {"t_ms": m["minute"] * 60_000,
               "attainment": {t: attainment([m], t)["attainment"] for t in cfg.tier_names},
               "all": attainment([m])}
        lat = latency.get(m["minute"], {})
        row.update({k: lat.get(k) for k in ("n", "ttft_ms", "tpot_ms", "e2e_ms")})
        per_minute.append(row)
    workers = sorted(fleet.workers if fleet else [], key=lambda w: (w.role, w.worker_id))
    now_s = now_ms / 1000
    return {
        "now_ms": now_ms,
        "tiers": list(cfg.tier_names),
        "targets": {t.name: {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms} for t in cfg.tiers},
        "models": sorted(set(models.values())),
        "streams": streams,
        "workers": [{**asdict(w), "heartbeat_age_s": round(now_s - w.last_seen, 1)} for w in workers],
        "max_running": cfg.worker.max_running,
        "attainment_5m": {"all": attainment(last5), **{t: attainment(last5, t) for t in cfg.tier_names}},
        # Each model's, over all tiers (the page shows them once there are several).
        "attainment_5m_by_model": {name: attainment(last5, None, name) for name in sorted(set(models.values()))},
        "minutes": per_minute,
        "slowest": [{**asdict(o), "timeline": f"/v1/requests/{o.id}/timeline"}
                    for o in slowest(recent, SLOWEST, now_ms - WINDOW_MINUTES * 60_000)],
    }


def add_dashboard_routes(app: Any, cfg: SkylineConfig, keys: Keys, connections: Any, tenants: Tenants) -> None:
    """`connections()` -> (redis client, FleetView), both None until the app has started."""
    page = PAGE.read_text(encoding="utf-8")

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"cache-control": "no-cache"})

    @app.get("/dashboard/data")
    async def data(request: Request) -> JSONResponse:
        if not tenants.authenticate(request).sees_all:  # 401 without a key (when keys are on)
            raise ApiError(403, "the dashboard shows every tenant's traffic: it needs an operator key "
                                "(gateway.operator_api_keys)", code="operator_key_required")
        r, fleet = connections()
        if r is None:
            return JSONResponse({"error": "the gateway is not connected to Redis"}, status_code=503)
        try:
            body = await dashboard_data(r, fleet, cfg, keys, int(time.time() * 1000))
        except (RedisError, OSError) as exc:
            return JSONResponse({"error": f"cannot read Redis: {exc}"}, status_code=503)
        return JSONResponse(body, headers={"cache-control": "no-store"})
