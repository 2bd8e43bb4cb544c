"""Several models through one gateway, end to end on the `sim` engine (real processes, real Redis, the
`openai` client): the default model and a second one (the same sim model under another served name with
another context length), each served only by its own workers on its own queues; a model whose worker
joins the running fleet is served within a heartbeat, and its last worker leaving gives 503 at once; a
model no worker ever served is vLLM's 404; a restarted gateway knows every live model from the start."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest
import redis

from skyline.core.keys import Keys
from tests.fleet import Fleet
from tests.procs import wait_until

A = "skyline-sim"  # the fleet's default model (the sim engine's name, no flag)
B = "sim-b"  # a second model: its workers started with --served-model-name sim-b --max-model-len 512
HEARTBEAT_S = 1.0  # worker.heartbeat_s's default


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    f = Fleet(redis_url, "multi-model", "sim", tmp_path_factory.mktemp("multi-model-logs"))
    workers = {"prefill-a": ("prefill",), "decode-a": ("decode",),
               "elastic-b": ("elastic", "--served-model-name", B, "--max-model-len", "512")}
    with f.running(workers, timeout_s=120):
        wait_until(lambda: B in _listed(f.client(5)), 30, "the gateway lists the second model")
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout_s=30)


def _listed(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


def _chat(client: openai.OpenAI, model: str, content: str = "hello", **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=8, temperature=0, **kw)


def test_models_lists_each_model_with_its_own_context_length(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {A, B}
    assert cards[A].model_extra["max_model_len"] == 2048 and cards[B].model_extra["max_model_len"] == 512


def test_each_model_is_served_only_by_its_own_workers_on_its_own_queues(fleet, client):
    r = redis.Redis.from_url(fleet.redis_url)
    a_keys, b_keys = Keys(fleet.key_prefix), Keys(fleet.key_prefix, B)
    before_a = r.xlen(a_keys.stream("prefill", "standard"))
    before_b = r.xlen(b_keys.stream("prefill", "standard"))
    for _ in range(3):
        a = _chat(client, A)
        assert a.model == A
        assert {a.model_extra["skyline"]["prefill_worker"], a.model_extra["skyline"]["decode_worker"]} \
            <= {"prefill-a", "decode-a"}
        b = _chat(client, B)
        assert b.model == B
        ext = b.model_extra["skyline"]
        assert ext["decode_worker"] == "elastic-b" and ext.get("prefill_worker") in (None, "", "elastic-b")
    # Each model's requests went through its own streams (min_remote_prefill_tokens 0: every prompt
    # is queued for a prefill), never the other's.
    assert r.xlen(a_keys.stream("prefill", "standard")) == before_a + 3
    assert r.xlen(b_keys.stream("prefill", "standard")) == before_b + 3
    assert b_keys.stream("prefill", "standard") == f"{fleet.key_prefix}:{{prefill:{B}}}:standard"


def test_a_request_is_checked_against_its_own_models_context_length(client):
    long = "x" * 700  # ~700 tokens with the sim byte tokenizer: over B's 512, under A's 2048
    assert _chat(client, A, long).usage.prompt_tokens > 512
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, B, long)
    assert "512" in err.value.message


def test_a_model_no_worker_ever_served_is_vllms_unknown_model_error(client):
    with pytest.raises(openai.NotFoundError) as err:
        _chat(client, "no-such-model")
    body = err.value.body
    assert err.value.status_code == 404
    assert body["message"].startswith("The model `no-such-model` does not exist.") and body["param"] == "model"
    assert body["type"] == "NotFoundError"


def test_a_new_models_worker_is_served_within_a_heartbeat_and_its_last_leaving_gives_503(fleet, client):
    c = "sim-c"
    r = redis.Redis.from_url(fleet.redis_url)
    fleet.start_worker("decode-c", "decode", "--served-model-name", c, "--max-model-len", "1024")
    try:
        # Registered: its first heartbeat is in Redis (the worker is up). From then on, one heartbeat.
        wait_until(lambda: r.exists(f"{fleet.key_prefix}:worker:decode-c"), 60, "decode-c registered")
        t0 = time.monotonic()
        wait_until(lambda: c in _listed(client), 5, "the gateway lists sim-c")
        assert time.monotonic() - t0 <= HEARTBEAT_S + 0.5
        # A short prompt with no prefill worker of sim-c: the colocated route, on sim-c's decode worker.
        resp = client.chat.completions.create(model=c, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                              extra_headers={"x-skyline-route": "colocated"})
        assert resp.model == c and resp.model_extra["skyline"]["decode_worker"] == "decode-c"
        # The disaggregated route needs a prefill worker of sim-c, which it has not: 503 (not A's pool).
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=c, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_headers={"x-skyline-route": "disagg"})
        assert err.value.status_code == 503 and "sim-c" in err.value.message
    finally:
        fleet.stop("decode-c")
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=c, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_headers={"x-skyline-route": "colocated"})
    assert err.value.status_code == 503 and err.value.body["code"] == "no_workers"
    assert time.monotonic() - t0 < 2.0  # at once, not after a request timeout
    assert c not in _listed(client) and B in _listed(client)


def test_a_restarted_gateway_knows_every_live_model_at_once(fleet):
    fleet.stop("gateway")
    fleet.start_gateway()
    wait_until(lambda: _up(fleet), 60, "the gateway is back")
    client = fleet.client(timeout_s=30)
    assert set(_listed(client)) == {A, B}  # its first answer: no heartbeat waited for
    assert _chat(client, B).model_extra["skyline"]["decode_worker"] == "elastic-b"


def _up(fleet: Fleet) -> bool:
    try:
        return bool(fleet.health())
    except OSError:
        return False


def test_skyline_status_shows_each_models_queues_and_workers(fleet):
    out = subprocess.run([sys.executable, "-m", "skyline.cli", "status", "--once", "--json",
                          "--redis-url", fleet.redis_url, "--key-prefix", fleet.key_prefix],
                         capture_output=True, text=True, timeout=60, check=True)
    snap = json.loads(out.stdout)
    assert snap["models"][A] == {"keyspace": "", "workers": 2} and snap["models"][B] == {"keyspace": B, "workers": 1}
    rows = {(s["model"], s["stage"], s["tier"]): s for s in snap["streams"]}
    assert rows[(B, "prefill", "standard")]["length"] >= 3  # B's requests, on B's stream
    assert {w["worker_id"]: w["model"] for w in snap["workers"]} == {"prefill-a": A, "decode-a": A, "elastic-b": B}
    # Each model's SLO attainment beside the fleet's: its own requests' verdicts, which add up to the fleet's.
    by_model = {m: w["15m"]["all"]["done"] for m, w in snap["slo_attainment_by_model"].items()}
    assert by_model[A] >= 3 and by_model[B] >= 3 and by_model["sim-c"] == 3, by_model  # sim-c: gone, still counted
    assert sum(by_model.values()) == snap["slo_attainment"]["15m"]["all"]["done"]
    text = subprocess.run([sys.executable, "-m", "skyline.cli", "status", "--once",
                           "--redis-url", fleet.redis_url, "--key-prefix", fleet.key_prefix],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"{B}/prefill:standard" in text and f"{B}/elastic-b" in text and f"model {B}" in text


def test_the_default_model_keeps_the_plain_keys_and_another_gets_its_own():
    from skyline.core.keys import keyspace_of

    plain = Keys("skyline")
    assert (plain.stream("prefill", "interactive"), plain.backlog, plain.affinity_lanes("decode")) == \
        ("skyline:{prefill}:interactive", "skyline:backlog", "skyline:{decode}:lanes")
    assert keyspace_of(A, A) == "" and keyspace_of(A, "") == "" and keyspace_of("org/m {x}", A) == "org/m__x_"
    b = plain.for_model(keyspace_of(B, A))
    assert (b.stream("decode", "batch"), b.retry_stream("decode", "batch"), b.affinity_lane("decode", "batch", "w"),
            b.affinity_lanes("prefill"), b.backlog) == (
        f"skyline:{{decode:{B}}}:batch", f"skyline:{{decode:{B}}}:batch:retry", f"skyline:{{decode:{B}}}:batch:@w",
        f"skyline:{{prefill:{B}}}:lanes", f"skyline:backlog:{B}")
    # Request- and worker-scoped keys are shared by every model.
    assert (b.tokens("r"), b.run("r"), b.worker("w"), b.workers) == \
        (plain.tokens("r"), plain.run("r"), plain.worker("w"), plain.workers)


def test_the_command_line_names_the_default_model_before_its_model_flags():
    from skyline.cli import build_parser, config_from_args

    def cfg_of(*argv: str):
        args, rest = build_parser().parse_known_args(list(argv))
        args.engine_argv = rest
        return config_from_args(args)

    # A worker of another model, with the fleet's config: the default is what the config names.
    assert cfg_of("worker", "decode", "--engine", "sim", "--served-model-name", B).default_model == A
    assert cfg_of("gateway", "--engine", "sim", "--served-model-name", B).default_model == A
    assert cfg_of("gateway", "--served-model-name", B).default_model == "SmolLM2-135M-Instruct"
    assert cfg_of("gateway", "--engine", "sim", "--default-model", B).default_model == B


UP_CONFIG = f"""
# The default model: [engine] (the sim engine's skyline-sim); one more, with its own engine arguments:
[[models]]
elastic = 1
[models.vllm]
served-model-name = "{B}"
max-model-len = 512
"""


def test_skyline_up_starts_every_model_of_the_config_behind_one_gateway(redis_url, key_prefix, tmp_path):
    from skyline.core.net import free_port
    from tests.test_skyline_up import Terminal

    (tmp_path / "fleet.toml").write_text(UP_CONFIG)
    port = free_port()
    term = Terminal(["--config", str(tmp_path / "fleet.toml"), "--elastic", "1", "--redis-url", redis_url,
                     "--key-prefix", key_prefix, "--port", str(port), "--metrics-port-base", "0"], tmp_path)
    try:
        term.wait_for("Skyline is up", timeout_s=300)  # a loaded host: a gateway's imports alone took 80 s
        out = "".join(term.lines)
        assert f"{B}-elastic-0 | ready" in out and "elastic-0 | ready" in out
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=30)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {A, B} and cards[B].model_extra["max_model_len"] == 512
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "skyline.cli", "status", "--once", "--json", "--redis-url", redis_url,
             "--key-prefix", key_prefix], capture_output=True, text=True, timeout=60, check=True).stdout)
        model_of = {w["worker_id"]: w["model"] for w in status["workers"]}
        assert sorted(model_of.values()) == sorted([A, B])  # one elastic worker each
        for model in (A, B, A, B):
            resp = _chat(client, model)
            assert resp.model == model and resp.choices[0].message.content
            assert model_of[resp.model_extra["skyline"]["decode_worker"]] == model
    finally:
        assert term.ctrl_c() == 0


def test_a_models_table_is_checked_at_load_and_its_served_name_by_skyline_up(tmp_path):
    from skyline.cli import check_models
    from skyline.core.config import ConfigError, load_config

    def load(text: str):
        (tmp_path / "c.toml").write_text(text)
        return load_config(tmp_path / "c.toml", {"engine": {"kind": "sim"}})

    for text, why in (("[[models]]\n[models.vllm]\nserved-model-name = 'x'\n", "no workers"),
                      ("[[models]]\ndecode = 1\n", "name its model"),
                      ("[[models]]\ndecode = 1\nworkers = 2\n[models.vllm]\nmodel = 'x'\n", "unknown option(s) workers"),
                      ("[[models]]\ndecode = -1\n[models.vllm]\nmodel = 'x'\n", "at least 0"),
                      ("[[models]]\ndecode = 1\n[models.vllm]\nmodel = 'x'\n[models.vllm.decode]\nmax-model-len = 9\n",
                       "[models.vllm.decode] max-model-len: must be the same for every engine")):
        with pytest.raises(ConfigError) as err:
            load(text)
        assert why in str(err.value), (text, err.value)
    # The table's engine arguments are its own: [engine.vllm]'s (the default model's) are not inherited.
    cfg = load("[engine.vllm]\nmax-model-len = 1024\n[[models]]\ndecode = 1\n[models.vllm]\nserved-model-name = 'b'\n")
    assert cfg.engine.max_model_len == 1024 and cfg.models[0].engine(cfg.engine).max_model_len == 2048
    # A table served under the default model's name is refused before anything starts.
    from dataclasses import replace

    cfg = replace(load(f"[[models]]\nelastic = 1\n[models.vllm]\nserved-model-name = '{A}'\n"), default_model=A)
    with pytest.raises(SystemExit) as exit_:
        check_models(cfg)
    assert exit_.value.code == 2


def test_metrics_and_the_dashboard_show_each_models_series(fleet, client):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    for model in (A, B):
        _chat(client, model)
    with urllib.request.urlopen(f"{fleet.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    series = {(s.name, s.labels.get("model")): s for f in text_string_to_metric_families(text) for s in f.samples}
    for model in (A, B):  # the default model's series carry its served name too
        for name in ("skyline_gateway_requests_total", "skyline_gateway_ttft_seconds_count",
                     "skyline_gateway_tpot_seconds_count", "skyline_gateway_admission_total",
                     "skyline_gateway_slo_met_total", "skyline_queue_length", "skyline_queue_waiting",
                     "skyline_fleet_workers"):
            assert (name, model) in series, (name, model)
    workers = {(s.labels["model"], s.labels["role"]): s.value
               for f in text_string_to_metric_families(text) for s in f.samples if s.name == "skyline_fleet_workers"}
    assert (workers[(A, "prefill")], workers[(A, "decode")], workers[(B, "elastic")], workers[(B, "decode")]) == (1, 1, 1, 0)
    queues = {(s.labels["model"], s.labels["stage"], s.labels["tier"]): s.value
              for f in text_string_to_metric_families(text) for s in f.samples if s.name == "skyline_queue_length"}
    assert queues[(B, "prefill", "standard")] >= 1  # B's own stream, counted under B
    # A worker's series carry the model it serves.
    worker = fleet.worker_metrics("elastic-b")
    assert f'skyline_worker_ready{{model="{B}",role="elastic",worker="elastic-b"}} 1.0' in worker
    assert f'model="{B}"' in next(line for line in worker.splitlines() if line.startswith("skyline_worker_output_tokens_total"))
    # The dashboard's data: every model's streams, each naming its model.
    dash = _json(f"{fleet.url}/dashboard/data")
    assert set(dash["models"]) == {A, B}
    assert {(s["model"], s["stage"]) for s in dash["streams"]} >= {(A, "prefill"), (B, "prefill"), (B, "decode")}
    assert {w["worker_id"]: w["model"] for w in dash["workers"]}["elastic-b"] == B
    assert dash["attainment_5m_by_model"][B]["done"] >= 1 and dash["attainment_5m_by_model"][A]["done"] >= 1


def _json(url: str):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_the_responses_api_serves_another_model_and_its_stored_responses_keep_it(client):
    first = client.responses.create(model=B, input="hello", max_output_tokens=8, temperature=0)
    assert first.model == B and first.output_text
    assert first.model_extra["skyline"]["decode_worker"] == "elastic-b"  # B's worker, not A's
    assert client.responses.retrieve(first.id).model == B  # stored with its model
    # The conversation goes on with B, and (as the API allows) with A: each turn on its own model's workers.
    second = client.responses.create(model=B, input="and then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.model == B and second.model_extra["skyline"]["decode_worker"] == "elastic-b"
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn's input and output rendered in
    third = client.responses.create(model=A, input="and now?", previous_response_id=second.id,
                                    max_output_tokens=8, temperature=0)
    assert third.model == A and third.model_extra["skyline"]["decode_worker"] in ("prefill-a", "decode-a")
    assert client.responses.retrieve(third.id).model == A
    # Streamed, on B: its events and its stored copy name B.
    with client.responses.stream(model=B, input="stream it", max_output_tokens=8, temperature=0) as stream:
        done = stream.get_final_response()
    assert done.model == B and client.responses.retrieve(done.id).model == B


def test_a_lora_adapter_loaded_at_run_time_names_its_base_model(fleet, client, tmp_path):
    import httpx

    adapter = tmp_path / "b-sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    gw = httpx.Client(base_url=fleet.url, timeout=30)
    body = {"lora_name": "b-sql", "lora_path": str(adapter)}
    # Both models' (sim) workers run LoRA: vLLM's request names no base model, so the load must.
    unnamed = gw.post("/v1/load_lora_adapter", json=body)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["code"] == "base_model_required", unnamed.text
    assert A in unnamed.text and B in unnamed.text
    unknown = gw.post("/v1/load_lora_adapter", json={**body, "base_model_name": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "base_model_name", unknown.text
    loaded = gw.post("/v1/load_lora_adapter", json={**body, "base_model_name": B})
    assert loaded.status_code == 200, loaded.text
    try:
        cards = {m.id: m for m in client.models.list().data}
        assert cards["b-sql"].model_extra["parent"] == B
        for _ in range(2):  # the adapter's requests go to its base model's worker, under its base model's series
            resp = _chat(client, "b-sql")
            assert resp.model == "b-sql" and resp.model_extra["skyline"]["decode_worker"] == "elastic-b"
        assert 'skyline_gateway_requests_total{model="sim-b",route=' in gw.get("/metrics").text
    finally:
        gone = gw.post("/v1/unload_lora_adapter", json={"lora_name": "b-sql"})
    assert gone.status_code == 200, gone.text
    assert "b-sql" not in _listed(client)
