"""LoRA adapters with real vLLM engines, against plain `vllm serve --enable-lora --lora-modules`.

An adapter is made at test time from the default model with `peft` (skyline/tools/bench/lora.py
`make_adapters`, as the LoRA benchmark makes its adapters: rank 8 on q_proj/v_proj, seeded non-zero
weights, so it changes the greedy answer; nothing from a hub). Started once for this module,
side by side: a plain vLLM OpenAI server serving it as `sql` (`--enable-lora --lora-modules sql=PATH`),
and a Skyline fleet (one prefill and one decode worker on real vLLM engines, KV over NIXL) whose workers
take the same `--enable-lora --lora-modules sql=PATH`. Skyline's greedy answers with the adapter equal
the plain server's token for token, streamed and not, through both routes; and so do those of the same
adapter loaded at run time through the gateway, after an unload and a reload.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from skyline.tools.bench.lora import make_adapters
from tests.fleet import Fleet
from tests.vllm_reference import greedy_answer, reference_server, wait_up

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
ROUTES = ("disagg", "colocated")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from skyline.tools.model import resolve_model

    return make_adapters(resolve_model("default"), [str(tmp_path_factory.mktemp("lora") / "sql")])[0]


@pytest.fixture(scope="module")
def both(redis_url, tmp_path_factory, adapter):
    """(reference URL, Skyline fleet), started together (their engines load at once)."""
    logs = tmp_path_factory.mktemp("lora-logs")
    f = Fleet(redis_url, "lora-vllm", "vllm", logs, ["--model", "default"])
    cores = sorted(os.sched_getaffinity(0))
    static = (*LORA_FLAGS, "--lora-modules", f"sql={adapter}")
    workers = {"prefill-0": ("prefill", "--cpu-bind", str(cores[0]), *static),
               "decode-0": ("decode", "--cpu-bind", str(cores[-1]), *static)}
    # Run-time loads on too (vLLM's switch for its load routes), to compare how each refuses an adapter.
    with reference_server(MODEL, (*LORA_FLAGS, "--lora-modules", f"sql={adapter}"), logs / "reference.log",
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as (proc, url):
        with f.running(workers, timeout_s=600):
            wait_up(proc, url, logs / "reference.log")
            yield url, f


@pytest.fixture(scope="module")
def clients(both):
    url, fleet = both
    ref = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    return ref, fleet.client(timeout_s=120)


def _answer(client, model: str, kind: str, stream: bool, route: str | None = None) -> str:
    return greedy_answer(client, model, kind, stream, route)[0]


def test_the_adapter_changes_the_answer(clients):
    ref, _ = clients
    for kind in ("chat", "completion"):
        assert _answer(ref, "sql", kind, False) != _answer(ref, MODEL, kind, False), kind


@pytest.mark.parametrize("route", ROUTES)
def test_a_static_adapter_answers_as_plain_vllm_serve(clients, route):
    ref, sky = clients
    for kind in ("chat", "completion"):
        want = _answer(ref, "sql", kind, False)
        for stream in (False, True):
            assert _answer(sky, "sql", kind, stream, route) == want, (kind, stream, route)


def test_models_lists_the_adapter_with_its_parent(clients):
    ref, sky = clients
    cards = {m.id: m for m in sky.models.list().data}
    ref_cards = {m.id: m for m in ref.models.list().data}
    assert cards["sql"].model_extra["parent"] == ref_cards["sql"].model_extra["parent"] == MODEL
    assert cards["sql"].model_extra["root"] == ref_cards["sql"].model_extra["root"]


def test_an_adapter_loaded_at_run_time_unloaded_and_reloaded_answers_as_plain_vllm_serve(both, clients, adapter):
    url, fleet = both
    ref, sky = clients
    want = {kind: _answer(ref, "sql", kind, False) for kind in ("chat", "completion")}
    gw = httpx.Client(base_url=fleet.url, timeout=60)
    r = gw.post("/v1/load_lora_adapter", json={"lora_name": "sql-live", "lora_path": adapter})
    assert r.status_code == 200 and "sql-live" in r.text, r.text
    assert gw.post("/v1/load_lora_adapter", json={"lora_name": "sql-live", "lora_path": adapter}).status_code == 400
    missing = gw.post("/v1/load_lora_adapter", json={"lora_name": "nowhere", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 404, missing.text  # vLLM's own answer for an adapter it cannot find
    for route in ROUTES:
        for kind in ("chat", "completion"):
            for stream in (False, True):
                assert _answer(sky, "sql-live", kind, stream, route) == want[kind], (route, kind, stream)

    assert gw.post("/v1/unload_lora_adapter", json={"lora_name": "sql-live"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _answer(sky, "sql-live", "chat", False)
    assert "sql-live" not in {m.id for m in sky.models.list().data}

    assert gw.post("/v1/load_lora_adapter", json={"lora_name": "sql-live", "lora_path": adapter}).status_code == 200
    for route in ROUTES:
        assert _answer(sky, "sql-live", "chat", True, route) == want["chat"], route
        assert _answer(sky, "sql-live", "completion", False, route) == want["completion"], route
    # The engines that ran it say so in their heartbeats (what adapter-aware placement reads); the id
    # unloaded is gone from them (their two slots' cache now holds the reloaded one).
    import redis

    r = redis.Redis.from_url(fleet.redis_url)
    for worker in ("prefill-0", "decode-0"):
        held = (r.hget(f"{fleet.key_prefix}:worker:{worker}", "adapters") or b"").decode().split(",")
        assert "sql-live" in held, (worker, held)
        assert int(r.hget(f"{fleet.key_prefix}:worker:{worker}", "lora_slots")) == 2


def test_an_adapter_the_engine_refuses_is_refused_as_vllm_serve_refuses_it(both, adapter, tmp_path):
    """Rank 16 on engines of --max-lora-rank 8: the worker's check (vLLM's own reading of the adapter,
    workers/engines/vllm_engine.py check_adapter) refuses it before any engine loads it, with plain
    vllm serve's status and reason; the fleet does not list it."""
    import json
    import shutil

    url, fleet = both
    too_big = tmp_path / "rank-16"
    shutil.copytree(adapter, too_big)
    config = json.loads((too_big / "adapter_config.json").read_text())
    (too_big / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    body = {"lora_name": "rank-16", "lora_path": str(too_big)}
    plain = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    ours = httpx.post(f"{fleet.url}/v1/load_lora_adapter", json=body, timeout=60)
    reason = "LoRA rank 16 is greater than max_lora_rank 8"
    assert reason in plain.json()["error"]["message"], plain.text
    assert ours.status_code == plain.status_code and reason in ours.json()["error"]["message"], ours.text
    assert "rank-16" not in {m["id"] for m in httpx.get(f"{fleet.url}/v1/models", timeout=30).json()["data"]}


def test_an_adapter_the_engines_cache_has_no_room_for_is_left_to_vllms_step(both, clients, tmp_path):
    """The decode engine's cache (2 slots) holds adapters x and y, both decoding, when a request for z
    arrives: the worker leaves z's load to the vLLM step that runs it, as `vllm serve` does, so z is read
    once and x and y are not evicted under their running requests and read again (loading z on arrival
    evicted the least recently used of them, and the next step read it back). z's answer is plain
    `vllm serve`'s."""
    import concurrent.futures
    import threading

    from skyline.tools.bench.lora import WeightOpens
    from skyline.tools.model import resolve_model

    url, fleet = both
    ref, sky = clients
    names = ("x", "y", "z")
    paths = make_adapters(resolve_model("default"), [str(tmp_path / n) for n in names], seed=99)
    gw = httpx.Client(base_url=fleet.url, timeout=60)
    for name, path in zip(names, paths):
        assert gw.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}).status_code == 200
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                          timeout=60).status_code == 200
    want = _answer(ref, "z", "completion", False)
    for name in ("x", "y"):  # one after the other: the engine's cache is then x and y
        _answer(sky, name, "completion", False, "colocated")

    decoding = {name: threading.Event() for name in ("x", "y")}

    def long_decode(name: str) -> None:
        for _chunk in sky.completions.create(model=name, prompt="Count from one to one hundred:", max_tokens=96,
                                             temperature=0, stream=True,
                                             extra_headers={"x-skyline-route": "colocated"}):
            decoding[name].set()  # its first token: it holds a slot in the engine's steps

    opens = WeightOpens(paths)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(long_decode, name) for name in ("x", "y")]
            for name, started in decoding.items():
                assert started.wait(60), f"{name} did not start decoding"
            assert _answer(sky, "z", "completion", False, "colocated") == want
            for f in running:
                f.result()
        # z read once from a fresh engine; in this module, after the other adapters' runs, 1 or 2 reads
        # (not understood yet); loading z on arrival read 4 (x or y evicted under their requests, read back).
        assert opens.read() <= 2
    finally:
        opens.close()
