"""One way to reach Redis from every Skyline process: a single server, a Redis Cluster or Sentinel.

The URL says which (parsed by `parse_redis_url`, pure):

  redis://[user:password@]host:port/db       one server (rediss:// = TLS, unix:///path.sock)
  redis+cluster://[user:pw@]h1:p1,h2:p2       Redis Cluster; any reachable nodes, the rest is discovered
  redis+sentinel://[user:pw@]s1:26379,s2:26379/<master name>[/db]
                                              Sentinel: the current master of <master name>
  (rediss+cluster:// and rediss+sentinel:// use TLS to the data nodes)

`RedisConfig` adds what does not belong in a URL: credentials from a secret
(`password`, `username`) and TLS files (`tls_ca_cert`, `tls_cert`, `tls_key`).

`connect()` returns the matching redis-py asyncio client. In a cluster every
multi-key command must stay in one hash slot; the key map (skyline/core/keys.py)
gives the keys used together the same hash tag. `pubsub_endpoints()` gives
the gateway's token relay (which speaks RESP2 itself, gateway/relay.py) where
to subscribe: classic PUBLISH is broadcast to every node of a cluster, so any
node will do; with Sentinel it is the current master.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from skyline.core.config import RedisConfig

SINGLE, CLUSTER, SENTINEL = "single", "cluster", "sentinel"
_SCHEMES = {
    "redis": (SINGLE, False), "rediss": (SINGLE, True), "unix": (SINGLE, False),
    "redis+cluster": (CLUSTER, False), "rediss+cluster": (CLUSTER, True),
    "redis+sentinel": (SENTINEL, False), "rediss+sentinel": (SENTINEL, True),
}
DEFAULT_PORT = {SINGLE: 6379, CLUSTER: 6379, SENTINEL: 26379}


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names. `nodes` are the servers the URL lists (the sentinels for Sentinel)."""

    topology: str  # SINGLE, CLUSTER or SENTINEL
    nodes: tuple[tuple[str, int], ...] = ()
    unix_path: str = ""
    tls: bool = False
    username: str = ""
    password: str = ""
    db: int = 0
    master_name: str = ""  # Sentinel only

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(h for h, _ in self.nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a Skyline Redis URL (see the module docstring). Raises ValueError with the reason."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ValueError(f"unsupported Redis URL {url!r}: expected one of {', '.join(s + '://' for s in _SCHEMES)}")
    topology, tls = _SCHEMES[scheme.lower()]
    rest = rest.split("?", 1)[0]
    if scheme == "unix":
        if not rest.startswith("/"):
            raise ValueError(f"a unix:// Redis URL needs an absolute socket path: {url!r}")
        return RedisTarget(SINGLE, unix_path=rest)
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = ""
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user), unquote(pw) if colon else ""
        if not colon:  # "redis://secret@host" is a password, as redis-cli reads it
            username, password = "", unquote(user)
    nodes = tuple(_host_port(part, DEFAULT_PORT[topology], url) for part in hostlist.split(",") if part)
    if not nodes:
        raise ValueError(f"no host in Redis URL {url!r}")
    if topology == SINGLE and len(nodes) > 1:
        raise ValueError(f"several hosts in {url!r}: use redis+cluster:// or redis+sentinel://")
    segments = [unquote(s) for s in path.split("/") if s]
    master = ""
    if topology == SENTINEL:
        if not segments:
            raise ValueError(f"a redis+sentinel:// URL names the master: redis+sentinel://host:26379/<name>, got {url!r}")
        master = segments.pop(0)
    db = _int(segments[0], "database number", url) if segments else 0
    if topology == CLUSTER and db:
        raise ValueError(f"Redis Cluster has only database 0: {url!r}")
    return RedisTarget(topology, nodes, "", tls, username, password, db, master)


def _host_port(part: str, default_port: int, url: str) -> tuple[str, int]:
    if part.startswith("["):  # [IPv6]:port
        host, _, tail = part[1:].partition("]")
        return host, _int(tail[1:], "port", url) if tail.startswith(":") else default_port
    host, colon, port = part.rpartition(":")
    if not colon:
        return part, default_port
    return host, _int(port, "port", url)


def _int(text: str, what: str, url: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"bad {what} {text!r} in Redis URL {url!r}") from None


def target_of(cfg: RedisConfig) -> RedisTarget:
    """The URL's target with the credentials of `cfg` (which win over the URL's)."""
    t = parse_redis_url(cfg.url)
    return RedisTarget(t.topology, t.nodes, t.unix_path, t.tls, cfg.username or t.username,
                       cfg.password or t.password, t.db, t.master_name)


def tls_options(cfg: RedisConfig) -> dict[str, Any]:
    """redis-py's ssl_* connection arguments for `cfg` (empty without TLS)."""
    if not parse_redis_url(cfg.url).tls:
        return {}
    opts: dict[str, Any] = {"ssl": True, "ssl_cert_reqs": "required" if cfg.tls_verify else "none",
                            "ssl_check_hostname": cfg.tls_verify}
    if cfg.tls_ca_cert:
        opts["ssl_ca_certs"] = cfg.tls_ca_cert
    if cfg.tls_cert:
        opts["ssl_certfile"] = cfg.tls_cert
        opts["ssl_keyfile"] = cfg.tls_key or None
    return opts


def ssl_context(cfg: RedisConfig) -> ssl.SSLContext | None:
    """The same TLS settings as an SSLContext, for raw connections (the relay); None without TLS."""
    if not parse_redis_url(cfg.url).tls:
        return None
    ctx = ssl.create_default_context(cafile=cfg.tls_ca_cert or None)
    if not cfg.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
    return ctx


def connect(cfg: RedisConfig, *, max_connections: int | None = None, blocking_timeout_s: float | None = None,
            **options: Any) -> Any:
    """An asyncio client for `cfg`: redis.asyncio.Redis, or RedisCluster for a cluster URL.

    `max_connections` bounds the pool (per node in a cluster); with
    `blocking_timeout_s` a single-server pool makes callers wait that long
    for a free connection instead of failing. `options` go to every
    connection (e.g. socket_keepalive, health_check_interval).
    """
    import redis.asyncio as aioredis

    t = target_of(cfg)
    common: dict[str, Any] = {"username": t.username or None, "password": t.password or None,
                              **tls_options(cfg), **options}
    if t.topology != CLUSTER:  # RedisCluster has its own retry and reconnect logic
        common = {**retry_options(), **common}
    if t.topology == CLUSTER:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.nodes],
                            max_connections=max_connections or 100, **common)
    if t.topology == SENTINEL:
        from redis.asyncio.sentinel import Sentinel

        sentinel = Sentinel(list(t.nodes), sentinel_kwargs=SENTINEL_KWARGS, db=t.db, **common)
        return sentinel.master_for(t.master_name, **({"max_connections": max_connections} if max_connections else {}))
    if t.unix_path:
        common = {k: v for k, v in common.items() if not k.startswith("ssl")}
        pool_kwargs: dict[str, Any] = {"connection_class": aioredis.UnixDomainSocketConnection, "path": t.unix_path}
    else:
        ssl_on = common.pop("ssl", False)
        pool_kwargs = {"connection_class": aioredis.SSLConnection if ssl_on else aioredis.Connection,
                       "host": t.nodes[0][0], "port": t.nodes[0][1]}
    pool_cls = aioredis.BlockingConnectionPool if blocking_timeout_s is not None else aioredis.ConnectionPool
    if blocking_timeout_s is not None:
        pool_kwargs["timeout"] = blocking_timeout_s
    pool = pool_cls(db=t.db, max_connections=max_connections, **pool_kwargs, **common)
    return aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes its connections


def retry_options() -> dict[str, Any]:
    """Retry a command that hit a broken connection, after a short backoff.

    After a Redis restart every pooled connection is dead; without a retry the
    first command on each fails (redis-py's default is no retry) and a request
    in flight would fail for a connection the pool replaces at once. Skyline's
    writes are safe to repeat: stream entries are deduplicated by the hand-off
    and the run claim, output frames by their number (workers/runs.py), and
    the rest are idempotent or estimates (the backlog counter).
    """
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return {"retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError, ConnectionError, OSError]}


# How the sentinels themselves are reached: plain TCP without credentials (the URL's
# user, password and TLS apply to the data nodes they point at).
SENTINEL_KWARGS: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}


@dataclass(frozen=True)
class Endpoint:
    """One server to open a raw RESP connection to (the token relay's)."""

    host: str = ""
    port: int = 0
    unix_path: str = ""
    tls: ssl.SSLContext | None = None
    username: str = ""
    password: str = ""

    def __str__(self) -> str:
        return self.unix_path or f"{self.host}:{self.port}"


async def pubsub_endpoints(cfg: RedisConfig, near_key: str | None = None) -> list[Endpoint]:
    """Where to SUBSCRIBE, in the order to try them.

    Single server: that server. Sentinel: the master the sentinels report now
    (a failover changes it; the relay asks again when it reconnects). Cluster:
    a PUBLISH on any node reaches subscribers on all of them, but its reply
    counts only the publishing node's own subscribers; publishers that read
    that count (decode workers: 0 = the client has gone) publish from scripts
    on the node serving their keys' slot, so the node serving `near_key` comes
    first, then every node the URL lists.
    """
    t = target_of(cfg)
    ctx = ssl_context(cfg)
    if t.unix_path:
        return [Endpoint(unix_path=t.unix_path, username=t.username, password=t.password)]
    nodes = list(t.nodes)
    if t.topology == CLUSTER and near_key:
        client = connect(cfg)
        try:
            await client.initialize()
            owner = client.get_node_from_key(near_key)
            nodes = [(owner.host, int(owner.port))] + [n for n in nodes if n != (owner.host, int(owner.port))]
        finally:
            await client.aclose()
    if t.topology == SENTINEL:
        from redis.asyncio.sentinel import Sentinel

        sentinel = Sentinel(nodes, sentinel_kwargs=SENTINEL_KWARGS)
        try:
            nodes = [await sentinel.discover_master(t.master_name)]
        finally:
            for s in sentinel.sentinels:
                await s.aclose()
    return [Endpoint(h, p, "", ctx, t.username, t.password) for h, p in nodes]


def describe(cfg: RedisConfig) -> str:
    """The URL without its password, for logs."""
    t = target_of(cfg)
    where = t.unix_path or ",".join(f"{h}:{p}" for h, p in t.nodes)
    user = f"{t.username}@" if t.username else ("***@" if t.password else "")
    suffix = f"/{t.master_name}" if t.master_name else ""
    return f"{t.topology} {'rediss' if t.tls else 'redis'}://{user}{where}{suffix}/{t.db}"
