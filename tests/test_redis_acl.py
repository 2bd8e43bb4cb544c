"""The fleet runs as a restricted Redis ACL user (what `skyline up` sets up): every
part works, and that user cannot run admin commands."""

from __future__ import annotations

import pytest
import redis

from skyline.tools.redis_server import FLEET_USER, start_redis

from skyline.core.net import free_port
from tests.fleet import Fleet

PASSWORD = "fleet-test-pw"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("acl"), fleet_password=PASSWORD)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def test_fleet_user_cannot_run_admin_commands(acl_redis):
    r = redis.Redis(port=acl_redis, username=FLEET_USER, password=PASSWORD)
    r.set("acl-test", 1)  # data commands work
    assert r.client_setname("acl-test") and r.get("acl-test") == b"1"
    for cmd in (("CONFIG", "SET", "appendonly", "no"), ("FLUSHALL",), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"),
                ("DEBUG", "SLEEP", "0"), ("KEYS", "*"), ("MONITOR",), ("REPLICAOF", "NO", "ONE")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(*cmd)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis, username=FLEET_USER, password="wrong").ping()


def test_fleet_works_as_the_restricted_user(acl_redis, key_prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("SKYLINE_REDIS_PASSWORD", PASSWORD)  # how `skyline up` hands it down
    url = f"redis://{FLEET_USER}:@127.0.0.1:{acl_redis}/0"  # user from the URL, password from the environment
    fleet = Fleet(url, key_prefix, "sim", tmp_path)
    with fleet.running({"prefill-1": ("prefill",), "decode-1": ("decode",)}, timeout_s=60):
        client = fleet.client(timeout_s=30)
        for route in ("disagg", "colocated"):
            resp = client.completions.create(model="skyline-sim", prompt="hello", max_tokens=6,
                                             extra_headers={"x-skyline-route": route})
            assert len(resp.choices[0].text) == 6
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="skyline-sim", prompt="hello", max_tokens=6, stream=True) if c.choices)
        assert len(text) == 6
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("gateway", "prefill-1", "decode-1"))
    assert "NOPERM" not in logs and "no permissions" not in logs
