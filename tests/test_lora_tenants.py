"""LoRA adapters and who may use them, through a sim fleet (gateway and workers as processes, real Redis).

A tenant key limited to named models (`models=` on its line of the key file) sees only those in
/v1/models and gets vLLM's unknown-model 404 for any other, the same answer as for a name nobody
loaded. Adapter paths are read where the workers run: a gateway that cannot read the path (here: `~`
is another folder for the workers, as another host's home would be) still loads the adapter, and a
path no worker can read is refused as `vllm serve` refuses it.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.fleet import Fleet

BASE = "base"  # the served name of every process's model (--served-model-name)


def _adapter(folder, config: str | None = None):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(config or json.dumps({"peft_type": "LORA", "r": 8}))


def _client(fleet: Fleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, model: str) -> str:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0)
    return resp.model


@pytest.fixture
def fleet(redis_url, key_prefix, tmp_path):
    """One gateway and one decode worker whose `~` is its own folder (the adapters live there only)."""
    (tmp_path / "keys.txt").write_text(f"key-sql models=sql\nkey-base models={BASE},chat\nkey-all\n")
    (tmp_path / "cfg.toml").write_text(f'[gateway]\nmode = "colocated"\napi_key_file = "{tmp_path / "keys.txt"}"\n'
                                       '[engine]\nsim_max_loras = 2\n')
    home = tmp_path / "worker-home"
    _adapter(home / "adapters" / "sql")
    _adapter(home / "adapters" / "chat")
    _adapter(home / "adapters" / "broken", config="{not json")
    f = Fleet(redis_url, key_prefix, "sim", tmp_path,
              extra=["--config", str(tmp_path / "cfg.toml"), "--served-model-name", BASE],
              gateway_args=("--operator-api-key", "op-key"))
    f.start_gateway()
    f.start("decode-1", ["worker", "decode", *f._common(), "--worker-id", "decode-1"], env={"HOME": str(home)})
    try:
        f.wait_ready({"decode": 1}, 120)  # a busy machine starts the processes slowly
        yield f
    finally:
        f.stop_all()


def test_adapters_load_from_paths_only_the_workers_can_read_and_tenants_see_only_their_models(fleet):
    op = httpx.Client(base_url=fleet.url, timeout=30, headers={"Authorization": "Bearer op-key"})
    assert not os.path.exists(os.path.expanduser("~/adapters/sql"))  # the gateway's `~` has no adapters

    # Read where the engines run: the gateway cannot see these paths, its worker can.
    for name in ("sql", "chat"):
        loaded = op.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"~/adapters/{name}"})
        assert loaded.status_code == 200, loaded.text
    # Refused as vllm serve refuses them: nothing there is its 404, an adapter the engine cannot read its 500.
    missing = op.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "~/adapters/gone"})
    assert missing.status_code == 404 and "gone" in missing.json()["error"]["message"], missing.text
    broken = op.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": "~/adapters/broken"})
    assert broken.status_code == 500 and "cannot be read as JSON" in broken.json()["error"]["message"], broken.text
    assert {m.id for m in _client(fleet, "op-key").models.list().data} == {BASE, "sql", "chat"}

    # Each tenant sees and uses only its models; the key without models= every one.
    sql, base, every = (_client(fleet, k) for k in ("key-sql", "key-base", "key-all"))
    assert [m.id for m in sql.models.list().data] == ["sql"]
    assert {m.id for m in base.models.list().data} == {BASE, "chat"}
    assert {m.id for m in every.models.list().data} == {BASE, "sql", "chat"}
    assert _chat(sql, "sql") == "sql"
    assert _chat(base, "chat") == "chat" and _chat(base, BASE) == BASE
    assert _chat(every, "sql") == "sql"

    # Another tenant's adapter is answered as a model that does not exist, word for word.
    with pytest.raises(openai.NotFoundError) as other:
        _chat(sql, "chat")
    with pytest.raises(openai.NotFoundError) as nobody:
        _chat(sql, "nobody-loaded-this")
    assert other.value.body["message"] == "The model `chat` does not exist. Valid aliases: sql."
    assert nobody.value.body["message"] == "The model `nobody-loaded-this` does not exist. Valid aliases: sql."
    assert other.value.body["param"] == "model" and other.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        _chat(base, "sql")
    # A request that names no model is the gateway's own model's: a key limited to adapters may not use it.
    no_model = httpx.post(f"{fleet.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          headers={"Authorization": "Bearer key-sql"}, timeout=30)
    assert no_model.status_code == 404 and f"`{BASE}`" in no_model.json()["error"]["message"], no_model.text
    tokenize = httpx.post(f"{fleet.url}/tokenize", json={"model": "chat", "prompt": "hi"},
                          headers={"Authorization": "Bearer key-sql"}, timeout=30)
    assert tokenize.status_code == 404, tokenize.text
