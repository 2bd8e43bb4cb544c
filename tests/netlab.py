"""Several "hosts" on one machine: network namespaces joined by a bridge.

Each host is a network namespace with one interface, `eth0`, on a private /24;
the veth peers meet on a bridge inside a namespace of its own, so the hosts
reach each other and nothing else (no uplink, no default route). The test
process (the client) joins the bridge through one more veth from the root
namespace. Everything is created by `up()` as root with iproute2 and removed
by `down()`, which also ends any process still running in the namespaces.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import subprocess
import uuid
from pathlib import Path


class LabUnavailable(Exception):
    """This machine cannot create network namespaces (not root, no iproute2, no permission)."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


class NetLab:
    def __init__(self, hosts: list[str]):
        self.tag = uuid.uuid4().hex[:4]
        self.hosts = list(hosts)
        self.ns = {h: f"sky-{self.tag}-{h}" for h in hosts}
        self.switch = f"sky-{self.tag}-sw"
        self.subnet = self._free_subnet()
        self.addr = {h: f"{self.subnet}.{i + 2}" for i, h in enumerate(hosts)}
        self.client_addr = f"{self.subnet}.1"
        self._client_if = f"vsk{self.tag}c"  # interface names are limited to 15 characters
        self._created: list[str] = []

    @staticmethod
    def check_available() -> None:
        if os.geteuid() != 0:
            raise LabUnavailable("creating network namespaces needs root")
        if shutil.which("ip") is None:
            raise LabUnavailable("iproute2's `ip` is not installed (make install adds it)")
        probe = f"sky-probe-{uuid.uuid4().hex[:6]}"
        res = _ip("netns", "add", probe, check=False)
        if res.returncode != 0:
            raise LabUnavailable(f"`ip netns add` failed: {res.stderr.strip()}")
        _ip("netns", "del", probe, check=False)

    @staticmethod
    def _free_subnet() -> str:
        """A 10.x.y/24 no route of this machine covers: the lab must not shadow a real network."""
        routed = [ipaddress.ip_network(line.split()[0], strict=False)
                  for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines()
                  if line[:1].isdigit()]
        while True:
            subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
            if not any(ipaddress.ip_network(f"{subnet}.0/24").overlaps(net) for net in routed):
                return subnet

    def up(self) -> None:
        try:
            _ip("netns", "add", self.switch)
            self._created.append(self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i, host in enumerate(self.hosts):
                ns = self.ns[host]
                _ip("netns", "add", ns)
                self._created.append(ns)
                inner, outer = f"vsk{self.tag}{i}a", f"vsk{self.tag}{i}b"
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", inner, "name", "eth0", ns=ns)
                _ip("addr", "add", f"{self.addr[host]}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
                self._plug(outer)
            peer = f"vsk{self.tag}p"
            _ip("link", "add", self._client_if, "type", "veth", "peer", "name", peer)
            self._plug(peer)
            _ip("addr", "add", f"{self.client_addr}/24", "dev", self._client_if)
            _ip("link", "set", self._client_if, "up")
        except BaseException:
            self.down()
            raise

    def _plug(self, outer: str) -> None:
        _ip("link", "set", outer, "netns", self.switch)
        _ip("link", "set", outer, "master", "br0", ns=self.switch)
        _ip("link", "set", outer, "up", ns=self.switch)

    def down(self) -> None:
        """Remove everything `up()` made; safe to call twice and after a partial `up()`."""
        for ns in self._created:
            self.kill_all(ns)
        _ip("link", "del", self._client_if, check=False)  # also removes its peer
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)  # deleting a namespace removes its veths
        self._created.clear()

    @staticmethod
    def kill_all(ns: str) -> None:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host]]

    def tx_bytes(self, host: str) -> int:
        """Bytes sent by a host's eth0 (its own sysfs view, inside the namespace)."""
        out = subprocess.run([*self.exec_prefix(host), "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True, timeout=10).stdout
        return int(out)

    def popen(self, host: str, argv: list[str], log: Path) -> subprocess.Popen:
        return subprocess.Popen([*self.exec_prefix(host), *argv], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
