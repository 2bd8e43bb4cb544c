"""vLLM's engine arguments under vLLM's own names (issue 34 part 1): parsed and checked by vLLM's parser,
merged per role, the deprecated [engine] keys, the refusals, and what reaches AsyncEngineArgs. No engine
is started here (one real worker with `--max-num-seqs` runs in tests/test_e2e_vllm.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys

import pytest

from skyline.core import engine_args as ea
from skyline.core.config import ConfigError, EngineConfig, load_config


def _write(tmp_path, text: str):
    f = tmp_path / "s.toml"
    f.write_text(text)
    return f


def _engine(argv=(), tables=None, **fields) -> EngineConfig:
    vllm = ea.split_table(tables or {})
    return EngineConfig(kind="vllm", vllm=dataclasses.replace(vllm, argv=tuple(argv)), **fields)


@pytest.fixture(scope="module")
def model() -> str:
    from skyline.tools.model import resolve_model

    return resolve_model("default")


def _vllm_args(ec: EngineConfig, model: str, role: str = "decode"):
    from skyline.workers.main import build_engine

    return build_engine(ec, model, role=role)._engine_args()  # type: ignore[attr-defined]


# -- parsing and validation by vLLM's parser --------------------------------------------------------


def test_vllms_parser_reads_the_arguments_under_vllms_names_either_spelling():
    ec, given = ea.resolve(_engine(["--max-num-seqs", "7", "-tp", "2", "--max_model_len", "4096",
                                    "--enable-prefix-caching", "--compilation-config.mode", "0"]), "decode")
    assert given["max_num_seqs"] == 7 and given["tensor_parallel_size"] == 2
    assert given["enable_prefix_caching"] is True and given["compilation_config"].mode == 0
    assert ec.max_model_len == 4096  # Skyline reads its own copy of what it needs


@pytest.mark.parametrize("argv, says", [
    (["--max-num-seqs", "lots"], "the command line: argument --max-num-seqs: invalid int value: 'lots'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--max-nums-seqs", "3"], "unrecognized arguments: --max-nums-seqs 3 (did you mean --max-num-seqs?)"),
    (["--kv-cache-dtype", "int3"], "argument --kv-cache-dtype: invalid choice: 'int3'"),
])
def test_a_bad_value_gets_vllms_own_message(argv, says):
    with pytest.raises(ea.EngineArgsError) as caught:
        ea.resolve(_engine(argv), "decode")
    assert says in str(caught.value)


def test_the_config_tables_are_checked_by_vllms_parser_naming_the_table(tmp_path):
    cfg = load_config(_write(tmp_path, '[engine.vllm]\ntensor-parallel-size = 2\nmax_num_seqs = 16\n'
                                       'enforce-eager = false\nhf-overrides = {rope_theta = 10000}\n'))
    _ec, given = ea.resolve(cfg.engine, "prefill")
    assert given == {"tensor_parallel_size": 2, "max_num_seqs": 16, "enforce_eager": False,
                     "hf_overrides": {"rope_theta": 10000}}
    cfg = load_config(_write(tmp_path, "[engine.vllm]\nmax-num-seqz = 16\n"))
    with pytest.raises(ea.EngineArgsError, match=r"\[engine.vllm\]: unrecognized arguments: --max-num-seqz 16"):
        ea.resolve(cfg.engine, "decode")


# -- per role ---------------------------------------------------------------------------------------


def test_each_role_gets_every_engines_arguments_then_its_own_then_the_command_lines(tmp_path):
    cfg = load_config(_write(tmp_path, "[engine.vllm]\nmax-num-seqs = 16\nmax-num-batched-tokens = 512\n"
                                       "[engine.vllm.prefill]\nmax-num-batched-tokens = 1024\n"
                                       "[engine.vllm.decode]\nmax-num-seqs = 64\n"))
    prefill, p_given = ea.resolve(cfg.engine, "prefill")
    decode, d_given = ea.resolve(cfg.engine, "decode")
    assert (p_given["max_num_seqs"], prefill.max_num_batched_tokens) == (16, 1024)
    assert (d_given["max_num_seqs"], decode.max_num_batched_tokens) == (64, 512)
    assert cfg.engine.max_num_batched_tokens == 512  # what the gateway's admission reads: every engine's
    # `skyline up --max-num-seqs 8 --decode-engine-args "--max-num-seqs 9"`: the command line beats the file
    cli = dataclasses.replace(cfg.engine, vllm=dataclasses.replace(
        cfg.engine.vllm, argv=("--max-num-seqs", "8"), role_argv={"decode": ea.split_argv("--max-num-seqs 9")}))
    assert ea.resolve(cli, "prefill")[1]["max_num_seqs"] == 8
    assert ea.resolve(cli, "decode")[1]["max_num_seqs"] == 9


def test_what_every_engine_must_share_is_refused_per_role(tmp_path):
    with pytest.raises(ConfigError, match=r"\[engine.vllm.decode\] max-model-len: must be the same for every engine"):
        load_config(_write(tmp_path, "[engine.vllm.decode]\nmax-model-len = 4096\n"))
    ec = dataclasses.replace(_engine(), vllm=ea.VllmArgs(role_argv={"prefill": ("--dtype", "bfloat16")}))
    with pytest.raises(ea.EngineArgsError, match="--prefill-engine-args: --dtype must be the same for every engine"):
        ea.resolve(ec, "prefill")


# -- Skyline's former [engine] keys -----------------------------------------------------------------


def test_former_engine_keys_still_load_with_a_warning_naming_the_new_key(tmp_path, caplog):
    ea_warned = __import__("skyline.core.config", fromlist=["_warned"])._warned
    ea_warned.clear()
    with caplog.at_level(logging.WARNING, "skyline.config"):
        cfg = load_config(_write(tmp_path, '[engine]\nmax_model_len = 4096\nkv_block_size = 32\ndtype = "bfloat16"\n'))
    assert (cfg.engine.max_model_len, cfg.engine.kv_block_size, cfg.engine.dtype) == (4096, 32, "bfloat16")
    said = caplog.text
    assert "[engine] max_model_len is deprecated: write max-model-len = 4096 in [engine.vllm]" in said
    assert "[engine] kv_block_size is deprecated: write block-size = 32 in [engine.vllm]" in said
    # ... and they reach vLLM's parser like the new names
    assert ea.resolve(cfg.engine, "decode")[1] == {"max_model_len": 4096, "block_size": 32, "dtype": "bfloat16"}
    with pytest.raises(ConfigError, match=r"\[engine\] max_model_len and \[engine.vllm\] max-model-len both given"):
        load_config(_write(tmp_path, "[engine]\nmax_model_len = 4096\n[engine.vllm]\nmax-model-len = 1024\n"))


def test_the_gateway_reads_the_model_from_the_table_and_its_own_flags_win(tmp_path):
    path = _write(tmp_path, '[engine.vllm]\nmodel = "/models/a"\nmax-model-len = 4096\nserved-model-name = ["a"]\n')
    cfg = load_config(path)  # no vLLM needed: the gateway and the tools read the table as TOML gives it
    assert (cfg.engine.model, cfg.engine.max_model_len, cfg.engine.served_model_name) == ("/models/a", 4096, "a")
    cfg = load_config(path, {"engine": {"model": "/models/b", "max_model_len": None}})  # `skyline gateway --model`
    assert (cfg.engine.model, cfg.engine.max_model_len) == ("/models/b", 4096)


def test_nothing_given_keeps_skylines_cpu_defaults(model):
    assert not EngineConfig().vllm
    args = _vllm_args(EngineConfig(kind="vllm"), model)
    assert (args.dtype, args.max_model_len, args.enforce_eager) == ("float32", 2048, True)
    assert args.max_num_batched_tokens == 2048  # best-effort steps; the scheduler shapes others to 256
    assert args.additional_config["skyline_step"]["step_tokens"] == 256
    assert args.scheduling_policy == "priority" and args.kv_transfer_config.kv_connector == "NixlConnector"


# -- what reaches the engine ------------------------------------------------------------------------


def test_the_users_arguments_reach_vllms_engine_args(model):
    ec, _ = ea.resolve(_engine(["--max-num-seqs", "7", "--max-model-len", "1024", "--block-size", "32",
                                "--max-num-batched-tokens", "128", "--no-enforce-eager", "--seed", "3",
                                "--kv-cache-memory-bytes", "64M", "--additional-config", '{"mine": 1}']), "decode")
    args = _vllm_args(ec, model)
    assert (args.max_num_seqs, args.max_model_len, args.block_size, args.seed) == (7, 1024, 32, 3)
    assert args.enforce_eager is False and args.kv_cache_memory_bytes == 64 << 20  # the user's, over Skyline's defaults
    assert args.additional_config["mine"] == 1 and "skyline_step" in args.additional_config  # merged
    assert args.long_prefill_token_threshold == 112  # Skyline's -1: 7/8 of the user's step


def test_every_argument_of_vllms_parser_reaches_the_engine_or_is_refused(model):
    """An argument a vLLM upgrade adds cannot be dropped: every dest of vLLM's parser that is a field of
    AsyncEngineArgs arrives as given, except those Skyline sets (refused where they conflict) and the ones
    Skyline reads under its own names (EngineConfig; the previous test)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    class Marker:  # a value nobody else would set
        def __init__(self, name: str) -> None:
            self.name = name

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Marker) and other.name == self.name

        __hash__ = object.__hash__

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    dests = {a.dest for a in ea.parser()._actions} & fields
    given = {d: Marker(d) for d in dests}
    skyline = {"model": "m", "dtype": "float32", "kv_transfer_config": None}
    original = AsyncEngineArgs.__post_init__
    try:
        AsyncEngineArgs.__post_init__ = lambda self: None  # markers are no real values: vLLM's checks would refuse
        with pytest.raises(ea.EngineArgsError, match="--kv-transfer-config"):
            ea.engine_args(given, skyline)  # a controlled one, given otherwise: never silently overridden
        args = ea.engine_args(given, {"model": "m", "dtype": "float32"})
    finally:
        AsyncEngineArgs.__post_init__ = original
    dropped = {d for d in dests - set(ea.FIELD_OF) if getattr(args, d) != Marker(d)}
    assert not dropped, f"given but not passed to the engine: {sorted(dropped)}"
    assert len(dests) > 200  # vLLM's whole parser was walked


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'],
     "--kv-transfer-config = KVTransferConfig"),
    (["--kv-events-config", '{"enable_kv_cache_events": true}'],
     "Skyline subscribes to the engine's KV cache events"),
    (["--scheduler-cls", "my.Scheduler"], "Skyline installs its step-shaping scheduler"),
    (["--scheduling-policy", "fcfs"], "--scheduling-policy = 'fcfs': Skyline runs every engine with vLLM's priority"),
    (["--disable-log-stats"], "--disable-log-stats = True: the worker's load reports"),
    (["--no-enable-logging-iteration-details"], "each step's tokens and time are the worker's measured rates"),
    (["--additional-config", '{"skyline_step": {}}'], "its key skyline_step is the step-shaping scheduler's"),
    (["-dp", "2"], "--data-parallel-size = 2: one engine per worker: scale out with more workers"),
    (["--kv-offloading-size", "4"], "vLLM would replace the engine's NIXL connector with its offloading connector"),
    (["--served-model-name", "a", "b"], "the gateway serves one name for the fleet's model"),
])
def test_what_skyline_controls_is_refused_with_the_reason(argv, says):
    with pytest.raises(ea.EngineArgsError) as caught:
        ea.resolve(_engine(argv), "decode")
    assert "engine arguments refused (decode engines)" in str(caught.value) and says in str(caught.value)


def test_an_engine_of_several_ranks_needs_a_core_set_per_rank():
    with pytest.raises(ea.EngineArgsError, match=r"--tensor-parallel-size = 2: --cpu-bind '0-1' gives 1 core set\(s\) "
                                                 r"for an engine of 2 rank\(s\)"):
        ea.resolve(_engine(["-tp", "2"], cpu_bind="0-1"), "decode")
    assert ea.resolve(_engine(["-tp", "2"], cpu_bind="0|1"), "decode")[1]["tensor_parallel_size"] == 2
    with pytest.raises(ea.EngineArgsError, match="--pipeline-parallel-size = 1: --cpu-bind '0|1'"):
        ea.resolve(_engine(["--max-num-seqs", "4"], cpu_bind="0|1"), "decode")


def test_a_refusal_lifts_where_skyline_lets_go():
    ec = _engine(["--kv-offloading-size", "4", "--kv-events-config", '{"enable_kv_cache_events": true}'],
                 kv_transfer=False, prefix_cache_events=False)
    assert ea.resolve(ec, "decode")[1]["kv_offloading_size"] == 4
    no_scheduler = _engine(["--scheduler-cls", "my.Scheduler"], background_step_tokens=0, hold_background_steps=0,
                           best_effort_step_tokens=0)
    assert ea.resolve(no_scheduler, "decode")[1]["scheduler_cls"] == "my.Scheduler"
    assert ea.resolve(_engine(["--scheduling-policy", "priority"]), "decode")[1]["scheduling_policy"] == "priority"


def test_an_engine_without_a_prefix_cache_reports_none(model):
    """--no-enable-prefix-caching is taken with prefix affinity on: the engine then has no cache events, its
    worker reports no cache, and the gateway places none of its requests by prefix."""
    from skyline.workers.main import build_engine

    ec, _ = ea.resolve(_engine(["--no-enable-prefix-caching"]), "decode")
    engine = build_engine(ec, model)
    assert engine.cache_events is False  # type: ignore[attr-defined]
    assert engine._engine_args().kv_events_config is None  # type: ignore[attr-defined]


# -- the command line -------------------------------------------------------------------------------


def _cli(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "skyline.cli", *argv], capture_output=True, text=True, timeout=timeout)


def test_a_worker_given_a_bad_engine_argument_stops_at_start_with_vllms_message():
    done = _cli(["worker", "decode", "--redis-url", "redis://127.0.0.1:1/0", "--max-num-seqs", "lots"])
    assert done.returncode == 2
    assert "skyline worker decode: error: the command line: argument --max-num-seqs: invalid int value: 'lots'" \
        in done.stderr


def test_up_refuses_a_conflicting_argument_before_starting_anything(tmp_path):
    done = _cli(["up", "--engine", "sim", "--redis-port", "1", "--decode-engine-args", "--scheduling-policy fcfs",
                 "--prefill", "1"], timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "skyline up: error: engine arguments refused (decode engines)" in done.stderr
    assert "redis" not in done.stdout  # nothing was started


def test_the_cli_hands_engine_arguments_to_the_config():
    from skyline.cli import build_parser, config_from_args

    args, rest = build_parser().parse_known_args(["up", "--prefill", "1", "-tp", "2", "--prefill-engine-args",
                                                  "--max-num-batched-tokens 1024", "--port", "8100"])
    args.engine_argv = rest
    cfg = config_from_args(args)
    assert cfg.engine.vllm.argv == ("-tp", "2") and cfg.gateway.port == 8100
    assert cfg.engine.vllm.role_argv == {"prefill": ("--max-num-batched-tokens", "1024")}
    from skyline.tools.launcher import engine_argv

    assert engine_argv(cfg, "prefill") == ["-tp", "2", "--max-num-batched-tokens", "1024"]
    assert engine_argv(cfg, "decode") == ["-tp", "2"]


def test_skylines_own_worker_options_shadow_only_vllms_log_level():
    """`skyline worker` parses its own options first, then hands the rest to vLLM's parser: an option both
    have would never reach vLLM. Only options Skyline takes on purpose are in both: --log-level (Skyline's
    logging), --reasoning-parser (the gateway's) and --otlp-traces-endpoint (the worker hands it to its engine
    too, so vLLM's spans join the request's trace)."""
    from skyline.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    vllm_options = set(ea.parser()._option_string_actions)
    for command in ("worker", "up"):
        ours = set(sub.choices[command]._option_string_actions) - {"-h", "--help"}
        assert ours & vllm_options <= {"--log-level", "--reasoning-parser", "--otlp-traces-endpoint"}, command
