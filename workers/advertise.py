"""The address a worker gives other hosts, and the check that they can use it.

A worker tells other hosts where to reach it: decode engines pull KV blocks
from a prefill engine's NIXL side channel (the host/port inside every KV
handle), and Prometheus scrapes its HTTP endpoint. On one machine 127.0.0.1
is right; as soon as Redis (and so the rest of the fleet) is on another host,
a loopback address sends the other hosts to themselves, and the failure shows
up much later as KV pulls that hang or time out. So a worker refuses to start
with a loopback or wildcard advertised address while Redis is remote.

The checks are pure functions of the configured strings (no DNS): a Redis
named by a host name other than `localhost` counts as remote.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import replace

from skyline.core.config import SkylineConfig
from skyline.core.redisconn import RedisTarget, target_of

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class AddressError(ValueError):
    """An advertised address other hosts could not use; the message says what to set."""


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: resolved elsewhere, not guessed here


def is_wildcard(host: str) -> bool:
    """0.0.0.0 / :: mean "every interface" to bind(), and nothing to connect()."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def redis_is_local(target: RedisTarget) -> bool:
    """True when every Redis node is on this host (a unix socket, loopback addresses)."""
    return bool(target.unix_path) or all(is_loopback(h) for h in target.hosts)


def check_advertised(host: str, target: RedisTarget, option: str = "worker.advertise_host") -> None:
    """Raise AddressError if other hosts could not reach `host` in a fleet using `target`."""
    if is_wildcard(host):
        raise AddressError(
            f"{option} = {host!r} is a bind-all address, not one another host can connect to; "
            "set it to this host's address on the network the fleet shares (--advertise-host)")
    if is_loopback(host) and not redis_is_local(target):
        redis_at = ", ".join(f"{h}:{p}" for h, p in target.nodes)
        raise AddressError(
            f"{option} = {host!r} is a loopback address, but Redis is on another host ({redis_at}): "
            "workers on other hosts would connect to themselves (KV pulls from this engine would fail). "
            "Set --advertise-host (or SKYLINE_ADVERTISE_HOST) to this host's address that they can reach, "
            "or leave it empty to use the address this host reaches Redis from")


def route_address(host: str, port: int) -> str:
    """This host's source address for packets to host:port (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def resolve_advertise_host(cfg: SkylineConfig) -> str:
    """The configured advertised address, checked; or, when empty, 127.0.0.1 with a local
    Redis and otherwise the address this host uses to reach Redis."""
    target = target_of(cfg.redis)
    host = cfg.worker.advertise_host
    if not host:
        if redis_is_local(target):
            return "127.0.0.1"
        try:
            host = route_address(*target.nodes[0])
        except OSError as exc:
            raise AddressError(f"cannot tell which address of this host reaches Redis at "
                               f"{target.nodes[0][0]} ({exc}); set --advertise-host") from None
    check_advertised(host, target)
    return host


def with_advertised_addresses(cfg: SkylineConfig) -> SkylineConfig:
    """`cfg` with worker.advertise_host resolved and engine.nixl_host defaulted to it, both checked."""
    host = resolve_advertise_host(cfg)
    nixl_host = cfg.engine.nixl_host or host
    check_advertised(nixl_host, target_of(cfg.redis), "engine.nixl_host")
    return replace(cfg, worker=replace(cfg.worker, advertise_host=host),
                   engine=replace(cfg.engine, nixl_host=nixl_host))


def gateway_bind_warning(cfg: SkylineConfig) -> str | None:
    """A warning when the gateway listens on loopback only while the fleet spans hosts:
    allowed (a local proxy may front it) but usually a forgotten --host."""
    if is_loopback(cfg.gateway.host) and not redis_is_local(target_of(cfg.redis)):
        return (f"the gateway listens on {cfg.gateway.host} only, but Redis is on another host: "
                "clients on other hosts cannot reach it (use --host 0.0.0.0 or this host's address)")
    return None
