"""Reaching Redis: URL forms (pure), then real servers with an ACL user, TLS, and Sentinel.

Each real-server test also runs the gateway's token relay against that server,
since the relay opens its own raw connection (gateway/relay.py) and must honour
the same credentials, TLS files and topology as the redis-py clients.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from skyline.gateway.relay import Relay

from skyline.core import messages
from skyline.core.config import RedisConfig
from skyline.core.keys import Keys
from skyline.core.net import free_port
from skyline.core.redisconn import CLUSTER, SENTINEL, SINGLE, connect, describe, parse_redis_url, pubsub_endpoints
from skyline.tools.redis_server import redis_server_binary, start_redis, wait_for_redis

# ---- URL forms --------------------------------------------------------------------


def test_single_server_urls():
    t = parse_redis_url("redis://app:s%40cret@10.0.0.5:6380/3")
    assert (t.topology, t.nodes, t.username, t.password, t.db, t.tls) == (
        SINGLE, (("10.0.0.5", 6380),), "app", "s@cret", 3, False)
    assert parse_redis_url("rediss://cache.example").nodes == (("cache.example", 6379),)
    assert parse_redis_url("rediss://cache.example").tls
    assert parse_redis_url("redis://:pw@h:1/0").password == "pw"
    assert parse_redis_url("redis://pw@h:1/0").password == "pw"  # redis-cli reads a lone userinfo as the password
    assert parse_redis_url("unix:///run/redis.sock").unix_path == "/run/redis.sock"
    assert parse_redis_url("redis://[fd00::5]:7000/1").nodes == (("fd00::5", 7000),)


def test_cluster_and_sentinel_urls():
    c = parse_redis_url("redis+cluster://u:p@n1:7000,n2:7001,n3")
    assert (c.topology, c.nodes, c.username, c.password) == (
        CLUSTER, (("n1", 7000), ("n2", 7001), ("n3", 6379)), "u", "p")
    s = parse_redis_url("rediss+sentinel://s1,s2:26380/mymaster/2")
    assert (s.topology, s.nodes, s.master_name, s.db, s.tls) == (
        SENTINEL, (("s1", 26379), ("s2", 26380)), "mymaster", 2, True)


@pytest.mark.parametrize("url,reason", [
    ("http://h:6379", "unsupported"),
    ("redis://h1:6379,h2:6379", "redis\\+cluster"),
    ("redis+sentinel://s1:26379", "names the master"),
    ("redis+cluster://n1:7000/2", "only database 0"),
    ("redis://h:port/0", "bad port"),
    ("redis:///0", "no host"),
])
def test_bad_urls_say_why(url, reason):
    with pytest.raises(ValueError, match=reason):
        parse_redis_url(url)


def test_config_credentials_win_over_the_url_and_logs_never_show_a_password():
    cfg = RedisConfig(url="redis://u:urlpw@h:1/0", password="secretpw", username="acl")
    assert "secretpw" not in describe(cfg) and "urlpw" not in describe(cfg) and "acl@" in describe(cfg)
    ep = asyncio.run(pubsub_endpoints(cfg))[0]
    assert (ep.username, ep.password, ep.host, ep.port) == ("acl", "secretpw", "h", 1)


# ---- ACL user and password ------------------------------------------------------


async def _relay_round_trip(cfg: RedisConfig, publisher) -> None:
    """Subscribe through the relay, publish through a redis-py client: the frame arrives."""
    keys = Keys("conn-test")
    relay = Relay(cfg, keys)
    await relay.start(timeout_s=10)
    try:
        sub = await relay.subscribe("r1")
        frame = messages.TokenDelta("r1", 0, 0, [104, 105], "hi")
        assert await publisher.publish(keys.tokens("r1"), messages.encode(frame)) >= 1
        async with asyncio.timeout(5):
            assert (await sub.get()).text == "hi"
    finally:
        await relay.close()


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("acl-redis"), extra=(
        "--requirepass", "default-pw", "--user", "skyline", "on", ">skyline-pw", "~*", "&*", "+@all"))
    yield port
    proc.terminate()
    proc.wait(timeout=10)


async def test_acl_user_from_config_and_password_from_the_url(acl_redis):
    cfg = RedisConfig(url=f"redis://:wrong@127.0.0.1:{acl_redis}/0", username="skyline", password="skyline-pw")
    r = connect(cfg)
    try:
        assert await r.acl_whoami() in (b"skyline", "skyline")
        await _relay_round_trip(cfg, r)
    finally:
        await r.aclose()
    legacy = connect(RedisConfig(url=f"redis://:default-pw@127.0.0.1:{acl_redis}/0"))
    assert await legacy.ping()
    await legacy.aclose()


async def test_wrong_password_fails_loudly(acl_redis):
    from redis.exceptions import AuthenticationError

    r = connect(RedisConfig(url=f"redis://skyline:nope@127.0.0.1:{acl_redis}/0"))
    with pytest.raises(AuthenticationError):
        await r.ping()
    await r.aclose()


# ---- TLS ------------------------------------------------------------------------
# The bundled redis-server is built without TLS, so a TLS-terminating proxy in
# front of it stands in for a TLS Redis: the client side (certificate checks,
# client certificates, host names) is exactly what a managed Redis would see.


def _make_certs(d: Path) -> dict[str, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=skyline-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=skyline")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "client.pem", "-days", "2")
    return {name: d / f"{name}.pem" for name in ("ca", "server", "client")} | {
        "server_key": d / "server.key", "client_key": d / "client.key"}


async def _tls_proxy(certs: dict[str, Path], backend_port: int, require_client_cert: bool):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs["server"], certs["server_key"])
    if require_client_cert:
        ctx.load_verify_locations(certs["ca"])
        ctx.verify_mode = ssl.CERT_REQUIRED

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    return _make_certs(tmp_path_factory.mktemp("tls"))


async def test_tls_with_a_private_ca_and_a_client_certificate(redis_url, certs):
    backend = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    server = await _tls_proxy(certs, backend, require_client_cert=True)
    port = server.sockets[0].getsockname()[1]
    try:
        cfg = RedisConfig(url=f"rediss://localhost:{port}/0", tls_ca_cert=str(certs["ca"]),
                          tls_cert=str(certs["client"]), tls_key=str(certs["client_key"]))
        r = connect(cfg)
        try:
            assert await r.ping()
            await _relay_round_trip(cfg, r)
        finally:
            await r.aclose()
        # Without the private CA the server certificate is not trusted: refused, not silently accepted.
        from redis.exceptions import ConnectionError as RedisConnectionError

        untrusted = connect(RedisConfig(url=f"rediss://localhost:{port}/0", tls_cert=str(certs["client"]),
                                        tls_key=str(certs["client_key"])))
        with pytest.raises(RedisConnectionError):
            await untrusted.ping()
        await untrusted.aclose()
    finally:
        server.close()


# ---- Sentinel -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory, redis_url):
    """A sentinel watching the session's Redis as master `skyline-main`."""
    master = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    d = tmp_path_factory.mktemp("sentinel")
    port = free_port()
    conf = d / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {d}\nsentinel monitor skyline-main 127.0.0.1 {master} 1\n"
                    "sentinel down-after-milliseconds skyline-main 5000\n")
    proc = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    wait_for_redis(port, proc)
    yield port, master
    proc.terminate()
    proc.wait(timeout=10)


async def test_sentinel_url_reaches_the_current_master(sentinel):
    port, master = sentinel
    cfg = RedisConfig(url=f"redis+sentinel://127.0.0.1:{port}/skyline-main/0")
    assert [(e.host, e.port) for e in await pubsub_endpoints(cfg)] == [("127.0.0.1", master)]
    r = connect(cfg)
    try:
        await r.set("conn-test:sentinel", "yes", ex=10)
        assert await r.get("conn-test:sentinel") == b"yes"
        await _relay_round_trip(cfg, r)
    finally:
        await r.aclose()
