"""Skyline across hosts: Redis, gateway, prefill and decode each on its own "host".

Four network namespaces joined by a bridge (tests/netlab.py) stand in for four
machines: each has one interface, eth0, and no route anywhere but the others.
Real vLLM engines; the workers are given no address, so each advertises the one
it reaches Redis from (its eth0); Redis requires an ACL user and password; UCX
may only use TCP on eth0, so the KV blocks cross from the prefill host to the
decode host over the bridge, which the prefill host's byte counter shows. The
`openai` client talks to the gateway from the root namespace.

Skipped only where namespaces cannot be created (not root, no iproute2).
Heavy (two engines): run under `flock /tmp/skyline-heavy.lock`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from skyline.tools.redis_server import redis_server_args, wait_for_redis
from tests.fleet import Fleet
from tests.netlab import LabUnavailable, NetLab

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"
REDIS_PORT, GATEWAY_PORT, NIXL_PORT = 6379, 8000, 5600


class NetnsFleet(Fleet):
    """The test fleet with every process on its lab host."""

    def __init__(self, lab: NetLab, redis_url: str, log_dir):
        super().__init__(redis_url, "mh", "vllm", log_dir, ["--model", "default"])
        self.lab = lab
        self.port = GATEWAY_PORT
        self.url = f"http://{lab.addr['gateway']}:{GATEWAY_PORT}"

    def host_of(self, name: str) -> str:
        return name.split("-")[0]  # gateway, prefill-0 -> prefill, decode-0 -> decode

    def wrap(self, name: str) -> list[str]:
        return self.lab.exec_prefix(self.host_of(name))

    def start(self, name, argv, env=None):
        # NIXL over UCX: TCP on the host's one interface (shared memory would bypass the "network").
        net = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
        return super().start(name, argv, {**net, **(env or {})})

    def start_gateway(self, *args: str) -> None:
        super().start_gateway("--host", self.lab.addr["gateway"], *args)


@pytest.fixture(scope="module")
def lab():
    try:
        NetLab.check_available()
    except LabUnavailable as exc:
        pytest.skip(f"multi-host test needs network namespaces: {exc}")
    net = NetLab(["redis", "gateway", "prefill", "decode"])
    net.up()
    try:
        yield net
    finally:
        net.down()  # also kills whatever still runs in the namespaces


@pytest.fixture(scope="module")
def redis_url(lab, tmp_path_factory):
    """Redis on its own host, reachable only with the `skyline` ACL user's password."""
    password = uuid.uuid4().hex
    data = tmp_path_factory.mktemp("mh-redis")
    argv = redis_server_args(REDIS_PORT, data, bind=lab.addr["redis"], extra=(
        "--requirepass", uuid.uuid4().hex, "--user", "skyline", "on", f">{password}", "~*", "&*", "+@all"))
    proc = lab.popen("redis", argv, data / "redis.log")
    wait_for_redis(REDIS_PORT, proc, host=lab.addr["redis"])
    yield f"redis://skyline:{password}@{lab.addr['redis']}:{REDIS_PORT}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fleet(lab, redis_url, tmp_path_factory):
    f = NetnsFleet(lab, redis_url, tmp_path_factory.mktemp("mh-logs"))
    cores = sorted(os.sched_getaffinity(0))
    workers = {"prefill-0": ("prefill", "--cpu-bind", str(cores[0]), "--nixl-port", str(NIXL_PORT)),
               "decode-0": ("decode", "--cpu-bind", str(cores[-1]), "--nixl-port", str(NIXL_PORT))}
    with f.running(workers, timeout_s=600):
        yield f


def test_workers_advertise_their_own_host_address(fleet, lab, redis_url):
    out = subprocess.run([sys.executable, "-m", "skyline.cli", "status", "--redis-url", redis_url,
                          "--key-prefix", "mh", "--once", "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    workers = {w["worker_id"]: w for w in json.loads(out.stdout)["workers"]}
    assert workers["prefill-0"]["address"] == lab.addr["prefill"]  # derived from the route to Redis
    assert workers["decode-0"]["address"] == lab.addr["decode"]
    assert workers["prefill-0"]["nixl_port"] == NIXL_PORT and workers["prefill-0"]["metrics_port"] > 0


def _ask(client, route: str, prompt: str):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0,
        extra_headers={"x-skyline-route": route})
    return r.choices[0].message.content, r.model_extra["skyline"]


def test_kv_crosses_hosts_and_the_greedy_answer_matches_a_colocated_engine(fleet, lab):
    client = fleet.client(timeout_s=180)
    sent_before = lab.tx_bytes("prefill")
    disagg, ext = _ask(client, "disagg", "What is the capital of France?")
    kv_bytes = lab.tx_bytes("prefill") - sent_before
    colocated, ext_c = _ask(client, "colocated", "What is the capital of France?")

    assert "Paris" in disagg
    assert disagg == colocated  # the decode engine computing the prompt itself gives the same tokens
    assert ext["route"] == "disagg" and ext["prefill_worker"] == "prefill-0" and ext["decode_worker"] == "decode-0"
    kv = ext["kv_transfer"]
    assert kv["remote_prefill"] is True and ext_c["kv_transfer"]["remote_prefill"] is False
    assert kv["num_remote_tokens"] > 0, "the decode engine did not load the prompt's KV through NIXL"
    # The KV blocks (~46 KB per token for this model in float32) left the prefill host over its eth0.
    assert kv_bytes > kv["num_remote_tokens"] * 30_000, f"only {kv_bytes} bytes left the prefill host"
    print(f"KV over the lab network: {kv_bytes / 1e6:.1f} MB for {kv['num_remote_tokens']} prompt tokens")


def test_streamed_answer_across_hosts(fleet):
    client = fleet.client(timeout_s=180)
    stream = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=24,
                                       temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    whole = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=24,
                                      temperature=0, extra_headers={"x-skyline-route": "colocated"})
    assert streamed and streamed == whole.choices[0].text
