"""LoRA adapters through a whole fleet on the sim engine: loading and unloading fleet-wide, placement.

Gateway and workers as processes against one Redis (tests/fleet.py). The sim engine reports adapters
as vLLM's does (what it holds, its slots, its load time), so the fleet's adapter logic runs fast here:
a request waits for the worker whose engine holds its adapter; with that worker gone, another loads
it; a worker started after the load serves it; an unloaded adapter is dropped by every engine.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest
import redis

from skyline.core.keys import Keys
from tests.fleet import Fleet
from tests.procs import wait_until

MODEL = "sim"


@pytest.fixture
def adapter_dir(tmp_path):
    d = tmp_path / "adapter-sql"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(d)


def _held(r: redis.Redis, keys: Keys, worker: str) -> set[str]:
    return {a for a in (r.hget(keys.worker(worker), "adapters") or b"").decode().split(",") if a}


def _gateway_sees(fleet: Fleet, worker: str, adapter: str) -> bool:
    """The gateway's view of the fleet (its /dashboard/data: heartbeats, read every half second) has
    `worker`'s engine holding `adapter`."""
    data = httpx.get(f"{fleet.url}/dashboard/data", timeout=5).json()
    return any(w["worker_id"] == worker and adapter in w["adapters"].split(",") for w in data["workers"])


def _chat(client: openai.OpenAI, model: str, text: str = "hello") -> dict:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=4,
                                          temperature=0)
    assert resp.model == model
    return resp.model_extra["skyline"]


def test_adapters_load_fleet_wide_are_placed_on_their_holders_and_unload(redis_url, key_prefix, tmp_path, adapter_dir):
    (tmp_path / "cfg.toml").write_text('[gateway]\nmode = "colocated"\n[engine]\nsim_max_loras = 1\n')
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    r = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    with fleet.running({"decode-1": ("decode",), "decode-2": ("decode",)}, timeout_s=60):
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
        gw = httpx.Client(base_url=fleet.url, timeout=30)
        served = client.models.list().data[0].id
        with pytest.raises(openai.NotFoundError):
            _chat(client, "sql")
        loaded = gw.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapter_dir})
        assert loaded.status_code == 200, loaded.text
        cards = {m.id: m for m in client.models.list().data}
        assert cards["sql"].model_extra["parent"] == served and cards["sql"].model_extra["root"] == adapter_dir
        assert json.loads(r.hget(keys.adapters, "sql"))["path"] == adapter_dir

        # Nobody holds it yet: the shared queue, and admission counts one load.
        first = _chat(client, "sql")
        holder = first["decode_worker"]
        other = ({"decode-1", "decode-2"} - {holder}).pop()
        assert first["placement"] is None
        wait_until(lambda: _held(r, keys, holder) == {"sql"}, 5, f"{holder}'s heartbeat to list the adapter")
        wait_until(lambda: _gateway_sees(fleet, holder, "sql"), 5, "the gateway to see the holder")
        assert not _held(r, keys, other)
        assert float(r.hget(keys.worker(holder), "adapter_load_ms")) == pytest.approx(50.0)
        assert int(r.hget(keys.worker(holder), "lora_slots")) == 1

        # Now it waits for its holder, within its slack, and is served there.
        for i in range(4):
            ext = _chat(client, "sql", f"question {i}")
            assert ext["placement"] and ext["placement"]["worker"] == holder, ext
            assert ext["decode_worker"] == holder
            assert ext["placement"]["until_ms"] <= time.time() * 1000 + ext["slo_target"]["ttft_ms"]
        # A request for the base model is not placed by adapter.
        assert _chat(client, served)["placement"] is None

        # A second adapter: one slot per engine, so the workers end up holding one each.
        loaded = gw.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapter_dir})
        assert loaded.status_code == 200, loaded.text

        # A worker that joins later knows both adapters; with the holder gone, another worker loads it.
        fleet.start_worker("decode-3", "decode")
        fleet.wait_ready({"decode": 3}, 30)
        fleet.stop(holder, sig=signal.SIGKILL)
        t0 = time.monotonic()
        ext = _chat(client, "sql", "still there?")
        assert ext["decode_worker"] in (other, "decode-3")
        assert time.monotonic() - t0 < 5
        wait_until(lambda: "sql" in _held(r, keys, ext["decode_worker"]), 5, "the new holder's heartbeat")

        # Unloaded: refused at the gateway, and dropped by every engine within a heartbeat or two.
        assert gw.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        assert gw.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            _chat(client, "sql")
        wait_until(lambda: all("sql" not in _held(r, keys, w) for w in (other, "decode-3")), 5,
                   "every engine to drop the unloaded adapter")
        assert "sql" not in {m.id for m in client.models.list().data}
        assert r.hget(keys.adapters, "sql") is None

        # Loaded again: a new fleet-wide id, served again.
        old_id = json.loads(r.hget(keys.adapters, "chat"))["lora_id"]
        assert gw.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapter_dir}).status_code == 200
        assert json.loads(r.hget(keys.adapters, "sql"))["lora_id"] > old_id
        _chat(client, "sql")


def test_loading_needs_an_operator_key_and_workers_that_run_lora(redis_url, key_prefix, tmp_path, adapter_dir):
    (tmp_path / "cfg.toml").write_text('[gateway]\nmode = "colocated"\n[engine]\nsim_max_loras = 0\n')
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")],
                  gateway_args=(*Fleet.EVERY_PROMPT_REMOTE, "--api-key", "tenant-key", "--operator-api-key", "op-key"))
    with fleet.running({"decode-1": ("decode",)}, timeout_s=60):
        gw = httpx.Client(base_url=fleet.url, timeout=30)
        body = {"lora_name": "sql", "lora_path": adapter_dir}
        assert gw.post("/v1/load_lora_adapter", json=body).status_code == 401
        tenant = gw.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer tenant-key"})
        assert tenant.status_code == 403, tenant.text
        op = gw.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer op-key"})
        assert op.status_code == 400 and "--enable-lora" in op.text, op.text  # no worker runs LoRA
        bad = gw.post("/v1/load_lora_adapter", json={"lora_name": "sql"}, headers={"Authorization": "Bearer op-key"})
        assert bad.status_code == 400
