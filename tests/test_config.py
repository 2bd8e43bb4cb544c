import pytest

from skyline.core.config import load_config


def test_defaults_are_consistent():
    cfg = load_config()
    assert cfg.default_tier in cfg.tier_names
    assert cfg.redis.url.startswith("redis://127.0.0.1")  # Redis is local-only by default


def test_file_then_overrides(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(
        'default_tier = "fast"\n'
        "[gateway]\nport = 9000\nmode = \"colocated\"\n"
        "[tiers.fast]\nttft_ms = 100\ntpot_ms = 10\npriority = 0\n"
    )
    cfg = load_config(f, {"gateway": {"port": 9100, "host": None}})
    assert cfg.gateway.port == 9100 and cfg.gateway.mode == "colocated" and cfg.gateway.host == "127.0.0.1"
    assert cfg.tier_names == ("fast",) and cfg.tier("fast").ttft_ms == 100


def test_unknown_options_are_rejected(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[gateway]\nprot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        load_config(f)


def test_sample_config_in_deploy_documents_every_option():
    import dataclasses
    import tomllib
    from pathlib import Path

    from skyline.core.config import is_option

    path = Path(__file__).parents[1] / "deploy" / "skyline.toml"
    cfg = load_config(path)
    assert cfg == load_config()  # the sample spells out the defaults
    data = tomllib.loads(path.read_text())
    for section in ("redis", "engine", "worker", "gateway", "observability", "batch"):
        documented = set(data[section])
        expected = {f.name for f in dataclasses.fields(getattr(cfg, section)) if is_option(f)}
        # Optional (None-default) fields cannot be written in TOML; they are documented as comments.
        text = path.read_text()
        missing = {n for n in expected - documented if f"# {n} =" not in text}
        assert not missing, f"[{section}] options missing from deploy/skyline.toml: {missing}"


def _load(tmp_path, text: str):
    f = tmp_path / "s.toml"
    f.write_text(text)
    return load_config(f)


@pytest.mark.parametrize("text, message", [
    # types: TOML gives strings where numbers belong, numbers where strings do
    ('[gateway]\nport = "8000"\n', "[gateway] port = '8000': expected an integer"),
    ("[engine]\nkv_cache_gib = true\n", "[engine] kv_cache_gib = True: expected a number"),
    ("[gateway]\nsheddable_tiers = [1]\n", "[gateway] sheddable_tiers = (1,): expected an array of strings"),
    ("[engine]\nnixl_port = \"x\"\n", "[engine] nixl_port = 'x': expected an integer (or unset)"),
    # ranges and choices
    ("[gateway]\nport = 70000\n", "[gateway] port = 70000: must be from 0 to 65535"),
    ("[worker]\nkv_watermark = 1.5\n", "[worker] kv_watermark = 1.5: must be above 0 and at most 1"),
    ("[worker]\nmax_running = 0\n", "[worker] max_running = 0: must be at least 1"),
    ("[engine]\nkv_cache_gib = -1\n", "[engine] kv_cache_gib = -1: must be at least 0"),
    ("[engine.vllm]\ngpu-memory-utilization = 0\n", "[engine.vllm] gpu-memory-utilization = 0: must be above 0 and at most 1"),
    ("[engine.vllm]\nmax_num_batched_tokens = -5\n", "[engine.vllm] max-num-batched-tokens = -5: must be at least 0"),
    ('[gateway]\nmode = "disaggregated"\n', "[gateway] mode = 'disaggregated': must be one of disagg, colocated"),
    ('[observability]\nlog_format = "xml"\n', "[observability] log_format = 'xml': must be one of text, json"),
    ('key_prefix = "my app"\n', "key_prefix = 'my app': must be non-empty"),
    ("[tiers.fast]\nttft_ms = 0\ntpot_ms = 10\npriority = 0\n", "[tiers.fast] ttft_ms = 0: must be a positive integer"),
    ("[tiers.fast]\nttft_ms = 100\npriority = 0\n", "[tiers.fast]: missing tpot_ms"),
    ("[tiers.fast]\nttft_ms = 100\ntpot_ms = 10\npriority = 0\nslo = 1\n", "[tiers.fast]: unknown option(s) slo"),
    # rules between values
    ("[worker]\nheartbeat_s = 5.0\nheartbeat_ttl_s = 4.0\n", "[worker] heartbeat_ttl_s = 4.0 must exceed heartbeat_s = 5.0"),
    ("[gateway]\nworker_liveness_s = 30.0\n", "[gateway] worker_liveness_s = 30.0 must be at most [worker] heartbeat_ttl_s"),
    ("[gateway]\nfirst_frame_timeout_s = 400.0\n", "first_frame_timeout_s = 400.0 must be at most request_timeout_s"),
    ("[gateway]\nrequest_timeout_s = 1000.0\n", "[redis] run_ttl_s = 900 must exceed [gateway] request_timeout_s"),
    ("[gateway]\nresponse_store_ttl_s = 60\n", "[gateway] response_store_ttl_s = 60 must exceed request_timeout_s"),
    ("[gateway]\nresponse_store_max_bytes = -1\n", "[gateway] response_store_max_bytes = -1: must be at least 0"),
    ("[batch]\nmin_concurrency = 8\nstart_concurrency = 4\n", "must be min <= start <= max"),
    ("[batch]\nfill_tokens = 4096\n", "[batch] fill_tokens = 4096 must be at most backoff_tokens = 2048"),
    ('[gateway]\nsheddable_tiers = ["interactiv"]\n', "sheddable_tiers names 'interactiv', which is not one of the tiers"),
    ('[batch]\ntier = "bulk"\n', "[batch] tier = 'bulk' is not one of the tiers"),
    ('default_tier = "fast"\n', "default_tier = 'fast' is not one of the tiers"),
    ("[engine.vllm]\nlong-prefill-token-threshold = 512\n",
     "[engine.vllm] long-prefill-token-threshold = 512 must be at most [engine.vllm] max-num-batched-tokens = 256"),
    ('[gateway]\napi_keys = ["k1", "k2"]\noperator_api_keys = ["k2"]\n',
     "[gateway] a key is in both api_keys and operator_api_keys"),
])
def test_a_bad_value_is_refused_at_load_naming_its_key(tmp_path, text, message):
    with pytest.raises(ValueError) as caught:
        _load(tmp_path, text)
    assert message in str(caught.value), str(caught.value)


def test_operator_keys_come_from_the_file_and_the_flag_and_are_never_named_in_errors(tmp_path):
    (tmp_path / "ops.txt").write_text("op-from-file  # the runner's\n\n")
    cfg = load_config(_write(tmp_path, f'[gateway]\noperator_api_key_file = "{tmp_path / "ops.txt"}"\n'),
                      {"gateway": {"operator_api_keys": ["op-from-flag"]}})
    assert cfg.gateway.operator_api_keys == ("op-from-flag", "op-from-file") and cfg.gateway.api_keys == ()
    (tmp_path / "keys.txt").write_text("op-from-file\n")
    with pytest.raises(ValueError) as caught:  # the same key as a tenant's too: refused, the key itself unsaid
        load_config(_write(tmp_path, f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n'
                                     f'operator_api_key_file = "{tmp_path / "ops.txt"}"\n'))
    assert "both api_keys and operator_api_keys" in str(caught.value) and "op-from-file" not in str(caught.value)


def _write(tmp_path, text: str):
    f = tmp_path / "s.toml"
    f.write_text(text)
    return f


def test_every_problem_is_listed_at_once(tmp_path):
    with pytest.raises(ValueError) as caught:
        _load(tmp_path, "[gateway]\nport = 70000\n[worker]\nmax_running = 0\n")
    assert "[gateway] port" in str(caught.value) and "[worker] max_running" in str(caught.value)


def test_flags_are_checked_like_the_file():
    with pytest.raises(ValueError, match=r"\[gateway\] port = 123456"):
        load_config(None, {"gateway": {"port": 123456}})


def test_the_shipped_configs_load(tmp_path):
    from pathlib import Path

    deploy = Path(__file__).parents[1] / "deploy"
    for name in ("skyline.toml", "skyline-gpu.toml"):
        load_config(deploy / name)


def test_a_sim_engine_steps_what_its_config_says():
    # One place for the defaults: the sim engine's timing and step size come from the engine config.
    from skyline.core.config import EngineConfig
    from skyline.workers.engines.sim import SimTiming
    from skyline.workers.main import build_engine

    assert SimTiming() == SimTiming.of(EngineConfig())
    engine = build_engine(EngineConfig(kind="sim", max_num_batched_tokens=128, sim_decode_base_s=0.002), "")
    assert engine.timing.max_batch_tokens == 128 and engine.timing.decode_base_s == 0.002
    assert build_engine(EngineConfig(kind="sim"), "").timing.max_batch_tokens == EngineConfig().max_num_batched_tokens


def test_the_kubernetes_config_is_the_gpu_preset():
    # deploy/kubernetes/base/config.yaml inlines deploy/skyline-gpu.toml (a ConfigMap cannot load a file
    # from outside its kustomization); what Kubernetes adds is the bind address, ports and the prefix.
    import dataclasses
    import tomllib
    from pathlib import Path

    import yaml

    deploy = Path(__file__).parents[1] / "deploy"
    preset = tomllib.loads((deploy / "skyline-gpu.toml").read_text())
    docs = list(yaml.safe_load_all((deploy / "kubernetes" / "base" / "config.yaml").read_text()))
    configmap = tomllib.loads(next(d for d in docs if d and d["kind"] == "ConfigMap")["data"]["skyline.toml"])
    k8s_only = {("gateway", "host"), ("gateway", "port"), ("worker", "metrics_port")}
    for section, values in preset.items():
        for key, value in values.items():
            assert configmap.get(section, {}).get(key) == value, f"[{section}] {key}: {value!r} in the preset"
    for section, values in configmap.items():
        for key in values if isinstance(values, dict) else ():
            assert key in preset.get(section, {}) or (section, key) in k8s_only, f"[{section}] {key} not in the preset"
    gpu, cpu = load_config(deploy / "skyline-gpu.toml"), load_config()
    assert gpu.engine.dtype != "float32" and gpu.engine.kv_cache_gib == 0  # not the CPU defaults
    from skyline.core.engine_args import FIELD_OF, dest
    preset_keys = set(preset["engine"]) | {FIELD_OF.get(dest(k)) for k in preset["engine"]["vllm"]}
    assert dataclasses.replace(gpu.engine, **{f.name: getattr(cpu.engine, f.name) for f in dataclasses.fields(cpu.engine)
                                               if f.name not in preset_keys}) == gpu.engine


def test_a_key_file_line_may_set_its_keys_limits_over_the_gateway_defaults(tmp_path):
    (tmp_path / "keys.txt").write_text("key-a tokens_per_minute=6000 strictest_tier=standard  # capped\n"
                                       "key-b\nkey-c strictest_tier=\nkey-a tokens_per_minute=6000 strictest_tier=standard\n"
                                       "key-d response_store_bytes=1000\n")
    cfg = load_config(_write(tmp_path, f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n'
                                       'tenant_tokens_per_minute = 100\ntenant_strictest_tier = "batch"\n'))
    g = cfg.gateway
    assert g.api_keys == ("key-a", "key-b", "key-c", "key-a", "key-d")
    assert [(k.where.rsplit(" ", 1)[-1], k.limits, k.response_store_bytes) for k in g.key_options] == [
        ("1", (6000, "standard"), None), ("3", (None, ""), None), ("4", (6000, "standard"), None),
        ("5", (None, None), 1000)]
    assert "key-a" not in repr(g.key_options)  # a secret: never in a repr

    from skyline.gateway.tenants import Tenants, key_digest
    tenants = Tenants(g)
    assert tenants.limits[key_digest("key-a", tenants.secret)] == (6000, "standard")
    assert tenants.limits[key_digest("key-c", tenants.secret)] == (100, "")  # "" = any tier, over the default
    assert tenants.default_limits == (100, "batch")  # key-b: the [gateway] defaults
    assert tenants.store_bytes == {key_digest("key-d", tenants.secret): 1000}  # the others: response_store_max_bytes


def test_a_key_file_line_may_name_the_models_its_key_may_use(tmp_path):
    (tmp_path / "keys.txt").write_text("key-a models=sql-lora,org/base-model:v2\nkey-b\n")
    g = load_config(_write(tmp_path, f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n')).gateway
    assert [k.models for k in g.key_options] == [("sql-lora", "org/base-model:v2")]  # key-b: every model

    from skyline.gateway.tenants import Tenants, key_digest
    tenants = Tenants(g)
    assert tenants.models == {key_digest("key-a", tenants.secret): frozenset({"sql-lora", "org/base-model:v2"})}


@pytest.mark.parametrize("lines, says", [
    ("key-a tokens_per_minute=lots\n", "line 1: tokens_per_minute='lots' must be a whole number"),
    ("key-a tokens_per_minute=-5\n", "tokens_per_minute='-5' must be a whole number of tokens, at least 0"),
    ("key-a tokens_per_mniute=5\n", "did you mean tokens_per_minute?"),
    ("\nkey-a key-b\n", "line 2: after the key, expected tokens_per_minute=N"),
    ("key-a strictest_tier=gold\n", "line 1: strictest_tier='gold' is not one of the tiers"),
    ("key-a\nkey-a tokens_per_minute=5\n", "line 2: the same key as"),
    ("key-a response_store_bytes=-1\n", "response_store_bytes='-1' must be a whole number of bytes, at least 0"),
    ("key-a\nkey-a response_store_bytes=5\n", "line 2: the same key as"),
    ("key-a models=\n", "line 1: models= names no model"),
    ("key-a models=x\nkey-a models=y\n", "line 2: the same key as"),
    ("key-a model=x\n", "did you mean models?"),
])
def test_a_bad_key_file_line_is_named_by_file_and_line_never_by_its_words(tmp_path, lines, says):
    (tmp_path / "keys.txt").write_text(lines)
    with pytest.raises(ValueError) as caught:
        load_config(_write(tmp_path, f'[gateway]\napi_key_file = "{tmp_path / "keys.txt"}"\n'))
    assert says in str(caught.value) and "key-a" not in str(caught.value) and "key-b" not in str(caught.value)


def test_operator_keys_take_no_limits_and_key_options_is_not_an_option(tmp_path):
    (tmp_path / "ops.txt").write_text("op-1 tokens_per_minute=5\n")
    with pytest.raises(ValueError, match="operator keys have none"):
        load_config(_write(tmp_path, f'[gateway]\noperator_api_key_file = "{tmp_path / "ops.txt"}"\n'))
    with pytest.raises(ValueError, match="key_options is not an option"):
        _load(tmp_path, "[gateway]\nkey_options = []\n")
    with pytest.raises(ValueError, match="tenant_strictest_tier = 'gold' is not one of the tiers"):
        _load(tmp_path, '[gateway]\ntenant_strictest_tier = "gold"\n')


def test_the_prefill_cap_never_exceeds_the_context_length():
    """vLLM refuses long_prefill_token_threshold > max_model_len: `skyline up --max-model-len 128` (one of
    vLLM's own tests' servers) stopped every engine at start with the derived cap of 224."""
    from skyline.core.config import EngineConfig

    assert EngineConfig(max_model_len=128).prefill_cap() == 128
    assert EngineConfig().prefill_cap() == 224  # 7/8 of the 256-token step, under the default 2048
    assert EngineConfig(max_model_len=128, long_prefill_token_threshold=0).prefill_cap() == 0  # no cap stays none
