"""`skyline up`: the whole fleet on one machine, as child processes.

Starts (unless --redis-url names an existing server) a local Redis bound to
127.0.0.1, then the gateway and the workers, each its own process running
`python -m skyline.cli ...` (the same commands a user runs by hand to scale
out), and one batch runner (`skyline batch-runner`, an RQ worker for batch
jobs). Their output is relayed with a name prefix. It prints the URLs and a
ready-to-paste request once the gateway and every worker are up. Ctrl-C (or
SIGTERM) stops everything it started, workers first so they can drain.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from skyline.config import SkylineConfig
from skyline.redis_server import FLEET_USER, free_port, start_redis


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


# Worker i of `skyline up` (prefill workers first) serves /metrics on this port + i;
# deploy/prometheus.yml scrapes exactly these ports.
METRICS_PORT_BASE = 9100


def _openai_surface_args(cfg: SkylineConfig) -> list[str]:
    """The gateway's tool/reasoning/chat-template settings as its flags (vllm serve's names)."""
    g = cfg.gateway
    out = ["--enable-auto-tool-choice"] if g.enable_auto_tool_choice else []
    for flag, value in (("--tool-call-parser", g.tool_call_parser), ("--reasoning-parser", g.reasoning_parser),
                        ("--chat-template", g.chat_template)):
        if value:
            out += [flag, value]
    return out


def plan_workers(cfg: SkylineConfig, n_prefill: int, n_decode: int,
                 metrics_port_base: int = METRICS_PORT_BASE) -> list[tuple[str, list[str]]]:
    """(name, extra CLI args) per worker. Real engines are pinned round-robin to
    cores (prefill first), so a prefill engine and a decode engine do not fight
    for the same core; a lone colocated decode worker gets every core. Each
    worker gets its own metrics port (`metrics_port_base` + i; 0 = free ports)."""
    if cfg.gateway.mode == "colocated":
        n_prefill = 0
    cores = _cores()
    plan = []
    roles = ["prefill"] * n_prefill + ["decode"] * n_decode
    for i, role in enumerate(roles):
        args = [role]
        if cfg.engine.kind == "vllm":
            bind = f"{cores[0]}-{cores[-1]}" if len(roles) == 1 else str(cores[i % len(cores)])
            args += ["--cpu-bind", bind]
            # A colocated fleet never moves KV: no NIXL connector at all.
            args += ["--no-kv-transfer"] if cfg.gateway.mode == "colocated" else ["--nixl-port", str(free_port())]
        if metrics_port_base:
            args += ["--metrics-port", str(metrics_port_base + i)]
        name = f"{role}-{sum(1 for r in roles[:i] if r == role)}"
        plan.append((name, args))
    return plan


def _relay(name: str, proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        sys.stdout.write(f"{name:>10} | {line.decode(errors='replace')}")
        sys.stdout.flush()


def _spawn(name: str, argv: list[str], env: dict[str, str], procs: list) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyline.cli", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C goes to us; we stop children in order
    )
    procs.append((name, proc))
    threading.Thread(target=_relay, args=(name, proc), daemon=True).start()
    return proc


def _common_args(cfg: SkylineConfig, args: argparse.Namespace) -> list[str]:
    out = ["--redis-url", cfg.redis.url, "--engine", cfg.engine.kind, "--key-prefix", cfg.key_prefix,
           "--max-model-len", str(cfg.engine.max_model_len)]
    if cfg.engine.kind == "vllm":
        out += ["--model", cfg.engine.model]
    if cfg.engine.served_model_name:
        out += ["--served-model-name", cfg.engine.served_model_name]
    if args.config:
        out += ["--config", args.config]
    out += ["--log-format", cfg.observability.log_format]
    return out


def _wait_ready(url: str, procs: list, want: dict[str, int], timeout_s: float) -> None:
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode} during start-up (see its log above)")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                workers = json.loads(resp.read()).get("workers", {})
                if all(workers.get(role, 0) >= n for role, n in want.items()):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"fleet not ready after {timeout_s:.0f}s")


def fleet_password(home: Path) -> str:
    """The local fleet's Redis password: made once, kept in $SKYLINE_HOME (mode 0600)."""
    path = home / "redis-fleet.password"
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def up(cfg: SkylineConfig, args: argparse.Namespace) -> int:
    # Ctrl-C and SIGTERM both stop the fleet, also when `up` was started in the
    # background by a shell (which starts it with SIGINT ignored).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    home = Path(os.environ.get("SKYLINE_HOME", "~/.cache/skyline")).expanduser()
    procs: list[tuple[str, subprocess.Popen]] = []
    redis_proc = None
    try:  # from here: a Ctrl-C, even during the first run's model preparation, stops what started
        if not args.redis_url and not os.environ.get("SKYLINE_REDIS_URL"):
            # The fleet connects as a restricted ACL user (no admin commands); the
            # default user stays for an operator's `redis-cli` on this machine only.
            password = fleet_password(home)
            redis_proc = start_redis(args.redis_port, home / "redis", args.redis_persistence, home / "redis.log",
                                     fleet_password=password, own_session=True)  # stopped last, below
            cfg = replace(cfg, redis=replace(cfg.redis, url=f"redis://{FLEET_USER}:@127.0.0.1:{args.redis_port}/0"))
            os.environ["SKYLINE_REDIS_PASSWORD"] = password  # children inherit it; never on a command line
        if cfg.engine.kind == "vllm":
            from skyline.model import resolve_model

            print(f"model: {resolve_model(cfg.engine.model)}", flush=True)  # prepares the default model once
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cfg.gateway.api_keys:  # in the environment, not on command lines, where `ps` shows them to everyone
            env["SKYLINE_API_KEYS"] = ",".join(cfg.gateway.api_keys)
        common = _common_args(cfg, args)
        gw = ["gateway", *common, "--host", args.host, "--port", str(args.port), "--mode", cfg.gateway.mode,
              *_openai_surface_args(cfg)]
        t0 = time.monotonic()
        _spawn("gateway", gw, env, procs)
        plan = plan_workers(cfg, args.prefill, args.decode, args.metrics_port_base)
        for name, extra in plan:
            _spawn(name, ["worker", extra[0], *common, *extra[1:]], env, procs)
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        # One batch runner (an RQ worker) runs batch jobs through this gateway (README "Batch jobs").
        _spawn("batch", ["batch-runner", *common, "--gateway-url", url], env, procs)
        want: dict[str, int] = {}
        for _, extra in plan:
            want[extra[0]] = want.get(extra[0], 0) + 1
        _wait_ready(url, procs, want, timeout_s=600)
        _banner(cfg, url, time.monotonic() - t0, plan)
        while all(p.poll() is None for _, p in procs):
            time.sleep(0.5)
        dead = [f"{n} (exit {p.returncode})" for n, p in procs if p.poll() is not None]
        print(f"skyline up: {', '.join(dead)} stopped; shutting down the fleet", flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nskyline up: stopping...", flush=True)
        return 0
    finally:
        _stop_all(procs)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)


def _stop_all(procs: list[tuple[str, subprocess.Popen]]) -> None:
    # Workers first (they drain and deregister), the gateway last.
    for _name, p in sorted(procs, key=lambda np: np[0] == "gateway"):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    for _name, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _banner(cfg: SkylineConfig, url: str, took_s: float, plan: list[tuple[str, list[str]]]) -> None:
    # The fleet connects as the restricted ACL user; an operator on this machine uses the default user.
    admin_url = cfg.redis.url.replace(f"{FLEET_USER}:@", "")
    from skyline.cli import model_identity

    _, model = model_identity(cfg)  # the default model is already prepared by now: cheap
    auth = f' -H "Authorization: Bearer {cfg.gateway.api_keys[0]}"' if cfg.gateway.api_keys else ""
    print(
        f"""
Skyline is up ({took_s:.0f}s): {cfg.gateway.mode} mode, engine {cfg.engine.kind}
  gateway   {url}   (OpenAI API: {url}/v1)
  redis     {admin_url}   (redis-cli -u {admin_url} ...)
  status    skyline status --redis-url {admin_url}
  dashboard {url}/dashboard
  metrics   {url}/metrics{_worker_metrics(plan)}
  trace     skyline trace <request id> --redis-url {admin_url}
  batches   skyline batch submit FILE.jsonl --gateway-url {url}   (one batch runner is running; rq info -u {admin_url})

Try it:
  curl {url}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'

Ctrl-C stops everything.
""",
        flush=True,
    )


def _worker_metrics(plan: list[tuple[str, list[str]]]) -> str:
    """The workers' /metrics URLs, one per line under the gateway's."""
    lines = []
    for name, args in plan:
        if "--metrics-port" in args:
            lines.append(f"\n            http://127.0.0.1:{args[args.index('--metrics-port') + 1]}/metrics  ({name})")
    return "".join(lines)
