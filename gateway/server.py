"""Run the gateway app under uvicorn (what `skyline gateway` calls)."""

from __future__ import annotations

import uvicorn

from skyline.core import frontend_args
from skyline.core.config import SkylineConfig
from skyline.gateway.app import create_app


def serve(cfg: SkylineConfig, model_path: str, served_model: str, max_model_len: int) -> None:
    """Serve until interrupted on `cfg.gateway.host:port`.

    uvloop and httptools are the fastest event loop and HTTP parser uvicorn
    supports; the access log is off because a log line per request costs more
    than the gateway's whole hot path (metrics count requests instead).
    """
    app = create_app(cfg, model_path, served_model, max_model_len)
    given = frontend_args.parse(cfg.gateway.vllm_args)  # vllm serve's server options (skyline/core/frontend_args.py)
    if given.get("root_path"):  # behind a proxy that routes a path prefix here: as vllm serve sets it
        app.root_path = given["root_path"]
    uvicorn.run(
        app,
        host=cfg.gateway.host,
        port=cfg.gateway.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=given.get("uvicorn_log_level", "info"),
        log_config=None,  # uvicorn's own lines go through Skyline's handler (skyline/core/logs.py: text or json)
        # On SIGTERM uvicorn stops accepting connections and lets open responses finish: as long as
        # the workers may drain theirs (worker.drain_timeout_s), so a fleet stopping as a whole
        # (skyline up's Ctrl-C, a rollout) delivers what its workers still finish.
        timeout_graceful_shutdown=cfg.worker.drain_timeout_s + 5,
    )
