"""Advertised addresses: the start-up check (pure), the CLI's refusal, the worker's HTTP endpoint."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace

import pytest

from skyline.core.config import SkylineConfig
from skyline.core.fleet import list_workers
from skyline.core.keys import Keys
from skyline.core.redisconn import parse_redis_url
from skyline.workers.advertise import (
    AddressError,
    check_advertised,
    gateway_bind_warning,
    is_loopback,
    redis_is_local,
    resolve_advertise_host,
    with_advertised_addresses,
)

REMOTE = parse_redis_url("redis://10.20.0.2:6379/0")
LOCAL = parse_redis_url("redis://127.0.0.1:6399/0")


@pytest.mark.parametrize("host,loop", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST.", True), ("10.0.0.7", False), ("fe80::1", False), ("redis", False), ("0.0.0.0", False),
])
def test_loopback_detection(host, loop):
    assert is_loopback(host) is loop


def test_redis_locality_from_the_url_alone():
    assert redis_is_local(LOCAL) and redis_is_local(parse_redis_url("unix:///run/redis.sock"))
    assert redis_is_local(parse_redis_url("redis+cluster://127.0.0.1:7000,localhost:7001"))
    assert not redis_is_local(REMOTE)
    assert not redis_is_local(parse_redis_url("redis://redis.internal:6379"))  # a name is never guessed local
    assert not redis_is_local(parse_redis_url("redis+cluster://127.0.0.1:7000,10.0.0.3:7001"))


def test_loopback_advertised_with_remote_redis_is_refused_with_the_fix_in_the_message():
    with pytest.raises(AddressError) as err:
        check_advertised("127.0.0.1", REMOTE)
    msg = str(err.value)
    assert "loopback" in msg and "10.20.0.2:6379" in msg and "--advertise-host" in msg


def test_wildcard_is_refused_even_on_one_host():
    for host in ("0.0.0.0", "::"):
        with pytest.raises(AddressError, match="bind-all"):
            check_advertised(host, LOCAL)


def test_reachable_addresses_pass():
    check_advertised("127.0.0.1", LOCAL)  # one machine: loopback is right
    check_advertised("10.20.0.5", REMOTE)
    check_advertised("worker-3.example", REMOTE)


def _cfg(url: str, advertise: str = "", nixl: str = "") -> SkylineConfig:
    cfg = SkylineConfig()
    return replace(cfg, redis=replace(cfg.redis, url=url), worker=replace(cfg.worker, advertise_host=advertise),
                   engine=replace(cfg.engine, nixl_host=nixl))


def test_empty_advertise_host_is_derived():
    assert resolve_advertise_host(_cfg("redis://127.0.0.1:6399/0")) == "127.0.0.1"
    # Remote Redis: the source address of the route to it (a UDP connect sends no packet).
    derived = resolve_advertise_host(_cfg("redis://127.0.0.2:6399/0"))
    assert derived.startswith("127.")  # the route to another loopback address stays on lo


def test_nixl_host_defaults_to_the_advertised_address_and_is_checked_too():
    cfg = with_advertised_addresses(_cfg("redis://10.20.0.2:6379/0", advertise="10.20.0.9"))
    assert cfg.worker.advertise_host == cfg.engine.nixl_host == "10.20.0.9"
    with pytest.raises(AddressError, match="engine.nixl_host"):
        with_advertised_addresses(_cfg("redis://10.20.0.2:6379/0", advertise="10.20.0.9", nixl="localhost"))


def test_gateway_on_loopback_with_remote_redis_gets_a_warning_only():
    cfg = _cfg("redis://10.20.0.2:6379/0")
    assert "another host" in gateway_bind_warning(cfg)
    assert gateway_bind_warning(replace(cfg, gateway=replace(cfg.gateway, host="0.0.0.0"))) is None
    assert gateway_bind_warning(_cfg("redis://127.0.0.1:6399/0")) is None


def test_worker_refuses_to_start_with_a_loopback_address_and_a_remote_redis():
    # The check runs before anything connects: this Redis host name is never looked up.
    proc = subprocess.run(
        [sys.executable, "-m", "skyline.cli", "worker", "decode", "--engine", "sim",
         "--redis-url", "redis://redis.invalid:6379/0", "--advertise-host", "127.0.0.1"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 1
    assert "loopback" in proc.stderr and "redis.invalid:6379" in proc.stderr


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_worker_endpoint_probes_metrics_and_advertised_address(redis_url, key_prefix):
    from skyline.workers.decode import DecodeHandler
    from skyline.workers.endpoint import WorkerEndpoint
    from skyline.workers.engines.sim import SimEngine
    from skyline.workers.runtime import WorkerRuntime

    cfg = SkylineConfig(key_prefix=key_prefix)
    cfg = replace(cfg, redis=replace(cfg.redis, url=redis_url),
                  worker=replace(cfg.worker, role="decode", worker_id="decode-ep", heartbeat_s=0.2))
    rt = WorkerRuntime(cfg, SimEngine(), "skyline-sim")
    endpoint = WorkerEndpoint(rt, "127.0.0.1", 0)
    port = endpoint.start()
    rt.info.address, rt.info.metrics_port = "127.0.0.1", port
    rt.on_start.append(endpoint.mark_ready)
    base = f"http://127.0.0.1:{port}"
    try:
        assert await asyncio.to_thread(_get, f"{base}/health") == (200, "ok\n")
        assert (await asyncio.to_thread(_get, f"{base}/ready"))[0] == 503  # engine not started yet
        task = asyncio.create_task(rt.run(DecodeHandler(rt.port), install_signals=False))
        for _ in range(100):
            if (await asyncio.to_thread(_get, f"{base}/ready"))[0] == 200:
                break
            await asyncio.sleep(0.05)
        status, text = await asyncio.to_thread(_get, f"{base}/metrics")
        assert status == 200
        assert 'skyline_worker_ready{model="skyline-sim",role="decode",worker="decode-ep"} 1.0' in text
        assert 'skyline_worker_kv_usage{model="skyline-sim",role="decode",worker="decode-ep"}' in text
        assert 'skyline_worker_requests_total{model="skyline-sim",outcome="completed",role="decode",worker="decode-ep"}' in text
        r = rt.redis
        [info] = [w for w in await list_workers(r, Keys(key_prefix), 10.0) if w.worker_id == "decode-ep"]
        assert (info.address, info.metrics_port) == ("127.0.0.1", port)
        rt.stopping.set()  # SIGTERM: drain, and stop being ready at once
        assert (await asyncio.to_thread(_get, f"{base}/ready"))[0] == 503
        await asyncio.wait_for(task, 20)
    finally:
        endpoint.stop()
