"""The fleet on a 3-node Redis Cluster (started locally from the bundled redis-server).

What must hold for a cluster (skyline/core/keys.py, docs/beyond-one-machine.md "Redis Cluster and Sentinel"):
keys used together in one command, transaction or Lua script share a hash tag,
and pub/sub works whichever node a publisher and a subscriber talk to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys

import pytest
import redis
from redis.crc import key_slot
from skyline.gateway.relay import Relay
from skyline.scheduler.tiers import DEFAULT_TIERS

from skyline.core import messages
from skyline.core.config import RedisConfig
from skyline.core.keys import STAGES, Keys
from skyline.core.redisconn import connect
from skyline.tools.redis_server import free_cluster_ports, start_redis_cluster
from tests.fleet import Fleet

MODEL = "skyline-sim"
TIERS = tuple(t.name for t in DEFAULT_TIERS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ports = free_cluster_ports(3)
    procs = start_redis_cluster(ports, tmp_path_factory.mktemp("cluster"))
    yield ports
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster_url(cluster):
    return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cluster)


def test_keys_used_together_share_a_slot():
    keys = Keys("skyline")
    for stage in STAGES:
        # One multi-key XREAD watches every tier stream of a stage, and their retry lanes.
        assert len({key_slot(key.encode()) for _t, key in keys.lanes(stage, tuple(TIERS))}) == 1
    decode_slot = key_slot(keys.stream("decode", "standard").encode())
    if hasattr(keys, "run"):  # Lua scripts touch a request's run state with the decode stream
        assert key_slot(keys.run("r1").encode()) == key_slot(keys.output("r1").encode()) == decode_slot
        # ... and its frame log, read back by the relay after a lost connection with the epoch.
        assert key_slot(keys.frames("r1").encode()) == key_slot(keys.epoch.encode()) == decode_slot
    # The two stages are different shards' business (not required, but what spreads the load).
    assert key_slot(keys.stream("prefill", "standard").encode()) != decode_slot


def test_publish_on_one_node_reaches_a_subscriber_on_another(cluster):
    """Classic PUBLISH is broadcast over the cluster bus: the relay may sit on any node."""
    first, *_, last = cluster
    keys = Keys("cluster-pubsub")

    async def run():
        relay = Relay(f"redis://127.0.0.1:{first}/0", keys)
        await relay.start()
        try:
            sub = await relay.subscribe("r1")
            frame = messages.TokenDelta("r1", 0, 0, [111, 107], "ok")
            other = redis.Redis(port=last)
            other.publish(keys.tokens("r1"), messages.encode(frame))
            other.close()
            async with asyncio.timeout(5):
                assert (await sub.get()).text == "ok"
        finally:
            await relay.close()

    asyncio.run(run())


def test_publish_from_a_decode_script_counts_the_relay(cluster_url):
    """In a cluster PUBLISH's reply counts the publishing node's subscribers only. Decode
    workers publish from scripts keyed to `{decode}` and take 0 to mean "client gone", so
    the relay must subscribe on the node serving that slot."""
    keys = Keys("cluster-near")

    async def run():
        cfg = RedisConfig(url=cluster_url)
        relay = Relay(cfg, keys)
        await relay.start()
        client = connect(cfg)
        try:
            sub = await relay.subscribe("r1")
            publish = client.register_script("return redis.call('PUBLISH', ARGV[1], ARGV[2])")
            frame = messages.encode(messages.TokenDelta("r1", 0, 0, [104, 105], "hi"))
            assert await publish(keys=[keys.stream("decode", "standard")], args=[keys.tokens("r1"), frame]) == 1
            async with asyncio.timeout(5):
                assert (await sub.get()).text == "hi"
        finally:
            await relay.close()
            await client.aclose()

    asyncio.run(run())


@pytest.fixture(scope="module")
def fleet(cluster_url, tmp_path_factory):
    f = Fleet(cluster_url, "clu", "sim", tmp_path_factory.mktemp("cluster-fleet"))
    workers = {"prefill-c": ("prefill",), "decode-c": ("decode",), "decode-d": ("decode",)}
    with f.running(workers, timeout_s=60):
        yield f


def test_fleet_on_a_cluster_answers_through_the_openai_client(fleet):
    client = fleet.client(timeout_s=30)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12)
    assert len(resp.choices[0].message.content) == 12 and resp.choices[0].finish_reason == "length"
    ext = resp.model_extra["skyline"]
    assert ext["route"] == "disagg" and ext["prefill_worker"] == "prefill-c"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True) if c.choices)
    assert streamed == resp.choices[0].message.content
    colocated = client.completions.create(model=MODEL, prompt="x" * 40, max_tokens=5,
                                          extra_headers={"x-skyline-route": "colocated"})
    assert colocated.usage.completion_tokens == 5

    def one(i):  # concurrent requests: admission's MULTI, acks and heartbeats all land on the cluster
        r = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=8,
                                      extra_headers={"x-slo-tier": TIERS[i % len(TIERS)]})
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(24))) == [8] * 24


def test_status_reads_the_cluster(fleet, cluster_url):
    out = subprocess.run([sys.executable, "-m", "skyline.cli", "status", "--redis-url", cluster_url,
                          "--key-prefix", "clu", "--once", "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert {w["worker_id"] for w in snap["workers"]} == {"prefill-c", "decode-c", "decode-d"}
    assert all(s["consumers"] >= 1 for s in snap["streams"])
    assert snap["redis"].startswith("cluster ")
