"""Run a real gateway (uvicorn, real sockets) in a background thread: for tests and benchmarks.

The app runs exactly as `serve()` runs it, only on a free loopback port and
in a thread of the calling process, so a test can drive it with the `openai`
client and inspect Redis directly. Nothing in here replaces a component.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import replace

import redis
import redis.asyncio as aioredis
import uvicorn

from skyline.core.config import SkylineConfig
from skyline.core.fleet import WorkerInfo, heartbeat
from skyline.core.keys import Keys
from skyline.gateway.app import create_app


class GatewayThread:
    """`with GatewayThread(cfg, model_path, "model", 2048) as gw:` -> `gw.url` ("http://127.0.0.1:PORT").
    `model_path` None: the sim engine's byte tokenizer (skyline/core/sim_model.py)."""

    def __init__(self, cfg: SkylineConfig, model_path: str | None, served_model: str, max_model_len: int,
                 port: int | None = None):
        if model_path is None:
            from skyline.core.sim_model import sim_model_dir

            model_path = str(sim_model_dir())
        port = port or _free_port()
        self.cfg = replace(cfg, gateway=replace(cfg.gateway, host="127.0.0.1", port=port))
        self.app = app = create_app(self.cfg, model_path, served_model, max_model_len)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", http="httptools",
                                access_log=False, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.server.run, name=f"gateway-{port}", daemon=True)

    def start(self, timeout_s: float = 15.0) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("gateway failed to start (see log)")
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not start in time")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def announce_workers(redis_url: str, keys: Keys, *roles: str, model: str = "sim", ttl_s: float = 180) -> None:
    """Heartbeat one worker per role exactly as a real worker does, for tests that play the
    workers by hand (the gateway refuses requests whose roles have no live worker)."""

    async def go() -> None:
        r = aioredis.from_url(redis_url)
        try:
            for i, role in enumerate(roles):
                now = time.time()
                info = WorkerInfo(f"{role}-hand-{i}", role, "sim", model, "127.0.0.1", 0, 0, 0, 0.0, now, now)
                await heartbeat(r, keys, info, ttl_s=ttl_s)
        finally:
            await r.aclose()

    asyncio.run(go())


def stream_lengths(redis_url: str, cfg: SkylineConfig) -> dict[str, int]:
    """XLEN of every work stream of the fleet (tests assert a refused request left none)."""
    r = redis.Redis.from_url(redis_url)
    try:
        return {key: r.xlen(key) for _stage, _tier, key in Keys(cfg.key_prefix).all_streams(cfg.tier_names)}
    finally:
        r.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
