"""`skyline up`: the whole fleet on one machine, as child processes.

Starts (unless --redis-url names an existing server) a local Redis bound to
127.0.0.1, then the gateway and the workers, each its own process running
`python -m skyline.cli ...` (the same commands a user runs by hand to scale
out), and one batch runner (`skyline batch-runner`, an RQ worker for batch
jobs). Each one's whole output goes to $SKYLINE_HOME/logs/<name>.log; the
terminal gets a line per process started and ready, a spinner meanwhile,
warnings and errors, then the banner (URLs, a ready-to-paste request) and the
fleet's request log (skyline/tools/progress.py decides; --verbose relays every line).
Ctrl-C (or SIGTERM) stops everything it started, workers first so they can drain.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from skyline.core import engine_args, envs
from skyline.core.config import EngineConfig, SkylineConfig
from skyline.core.envs import skyline_home
from skyline.core.lifetime import parent_death_signal
from skyline.core.net import listen_ports, port_holder, port_taken
from skyline.tools.progress import Console, LineFilter, Seen, rotate, tail
from skyline.scheduler.elastic import ROLES as WORKER_ROLES
from skyline.tools.redis_server import FLEET_USER, start_redis


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


# Worker i of `skyline up` (prefill workers first, then decode, then elastic) serves /metrics on this port + i;
# deploy/prometheus.yml scrapes exactly these ports.
METRICS_PORT_BASE = 9100
# A worker that exits while the fleet runs (killed, out of memory, its engine failed:
# workers/engine_watch.py) is started again, as compose's `restart: unless-stopped` or a Kubernetes
# Deployment would; live workers of its pool have taken its requests over meanwhile. More than
# this many exits of one worker within the window is a crash loop: the fleet stops and says so.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0


def _openai_surface_args(cfg: SkylineConfig) -> list[str]:
    """The gateway's tool/reasoning/chat-template settings as its flags (vllm serve's names)."""
    g = cfg.gateway
    out = ["--enable-auto-tool-choice"] if g.enable_auto_tool_choice else []
    for flag, value in (("--tool-call-parser", g.tool_call_parser), ("--reasoning-parser", g.reasoning_parser),
                        ("--chat-template", g.chat_template)):
        if value:
            out += [flag, value]
    return out


@dataclass(frozen=True)
class ModelWorkers:
    """One model `up` starts and its workers per role: [engine]'s (the default model: --prefill, --decode,
    --elastic) or a [[models]] table's (`config_model`: its served name, which its workers are started with)."""

    engine: EngineConfig
    prefill: int
    decode: int
    elastic: int
    config_model: str = ""

    @property
    def tag(self) -> str:
        """Its workers' names begin with it (a [[models]] table's served name, as a file name may hold it)."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.config_model) + "-" if self.config_model else ""


def fleet_models(cfg: SkylineConfig, n_prefill: int, n_decode: int, n_elastic: int = 0) -> list[ModelWorkers]:
    """The default model with these counts, then each [[models]] table of the config."""
    from skyline.tools.model import served_name

    out = [ModelWorkers(cfg.engine, n_prefill, n_decode, n_elastic)]
    for m in cfg.models:
        engine = m.engine(cfg.engine)
        out.append(ModelWorkers(engine, m.prefill, m.decode, m.elastic, served_name(engine)))
    return out


def plan_workers(cfg: SkylineConfig, n_prefill: int, n_decode: int,
                 metrics_port_base: int = METRICS_PORT_BASE, n_elastic: int = 0) -> list[tuple[str, list[str]]]:
    """(name, extra CLI args) per worker of every model (`fleet_models`). Real engines are pinned to cores
    (`core_binds`: every model's prefill engines first; elastic engines as decode engines, they run streams);
    each worker gets its own metrics port (`metrics_port_base` + i; 0 = free ports)."""
    models = fleet_models(cfg, n_prefill, n_decode, n_elastic)
    roles = ("decode", "elastic") if cfg.gateway.mode == "colocated" else ("prefill", "decode", "elastic")
    workers = [(m, role) for role in roles for m in models for _ in range(getattr(m, role))]  # prefill engines first
    n_prefill = sum(1 for _m, role in workers if role == "prefill")
    ranks = [engine_args.ranks(m.engine, role) for m, role in workers] if cfg.engine.kind == "vllm" else None
    binds = core_binds(n_prefill, len(workers) - n_prefill, _cores(), ranks)
    # Each engine's NIXL side channel: ports no outgoing connection can take before the engine binds
    # them, after loading its model (a free_port() here lost that race to another process, 2026-12-07),
    # one run per engine wide enough for all its ranks, disjoint across the fleet.
    moves_kv = cfg.engine.kind == "vllm" and cfg.gateway.mode != "colocated"
    nixl = listen_ports(len(workers), span=max(ranks or [1])) if moves_kv else []
    plan = []
    for i, (m, role) in enumerate(workers):
        args = [role]
        if m.config_model:
            args += ["--config-model", m.config_model]
        if cfg.engine.kind == "vllm":
            args += ["--cpu-bind", binds[i]]
            # A colocated fleet never moves KV: no NIXL connector at all.
            args += ["--nixl-port", str(nixl[i])] if moves_kv else ["--no-kv-transfer"]
        if metrics_port_base:
            args += ["--metrics-port", str(metrics_port_base + i)]
        name = f"{m.tag}{role}-{sum(1 for other, r in workers[:i] if r == role and other is m)}"
        plan.append((name, args))
    return plan


def core_binds(n_prefill: int, n_decode: int, cores: list[int], ranks: list[int] | None = None) -> list[str]:
    """The cores of each engine (prefill engines first): a lone engine gets every core; one core
    each while there are enough; with more engines than cores, each pool shares its own cores (in
    proportion to its engines) and no decode engine is put on a prefill engine's core: there, a
    decode engine's first KV pull from that prefill engine hung for 87 s, both executors stalled
    until the prefill engine's lease of the blocks ran out (3 of 3 times on 2 cores, 2026-12-03).
    `ranks`: each engine's processes (tensor x pipeline parallel; default 1 each). Each rank counts as
    an engine above and an engine's ranks' core sets are joined with `|` (a lone engine's cores split
    among its ranks): "0|1" for a TP=2 engine on two cores."""
    ranks = ranks or [1] * (n_prefill + n_decode)
    if n_prefill + n_decode == 1:
        return ["|".join(_span(part) for part in _split(cores, ranks[0]))]
    units = _unit_binds(sum(ranks[:n_prefill]), sum(ranks[n_prefill:]), cores)
    out, i = [], 0
    for r in ranks:
        out.append("|".join(units[i:i + r]))
        i += r
    return out


def _unit_binds(n_prefill: int, n_decode: int, cores: list[int]) -> list[str]:
    n = n_prefill + n_decode
    if n == 1:
        return [_span(cores)]
    if n <= len(cores) or not n_prefill or not n_decode or len(cores) == 1:
        return [str(cores[i % len(cores)]) for i in range(n)]
    k = min(len(cores) - 1, max(1, round(len(cores) * n_prefill / n)))  # the prefill pool's cores
    return ([str(cores[i % k]) for i in range(n_prefill)]
            + [str(cores[k + i % (len(cores) - k)]) for i in range(n_decode)])


def _split(cores: list[int], parts: int) -> list[list[int]]:
    """`cores` in `parts` contiguous runs as even as can be; with fewer cores than parts, parts share them."""
    if len(cores) < parts:
        return [[cores[i % len(cores)]] for i in range(parts)]
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(cores[start:end])
        start = end
    return out


def _span(cores: list[int]) -> str:
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


@dataclass
class Child:
    """One process `up` started: all its output goes to `log`; the terminal gets what `_relay` lets through."""

    name: str
    role: str  # gateway, prefill, decode, elastic or batch
    proc: subprocess.Popen
    log: Path
    relay: threading.Thread | None = None
    ready: bool = False
    argv: tuple[str, ...] = ()  # what it was started with (a worker is restarted with the same)


def _relay(child: Child, log: BinaryIO, console: Console, fleet_up: threading.Event, verbose: bool,
           seen: Seen) -> None:
    # Every line goes to the log file as it comes; the terminal gets all of them with --verbose,
    # else what LineFilter picks (skyline/tools/progress.py).
    assert child.proc.stdout is not None
    keep = LineFilter(seen)
    with log:
        for raw in iter(child.proc.stdout.readline, b""):
            log.write(raw)
            log.flush()  # a crash's last lines must be in the file when `up` shows its tail
            line = raw.decode(errors="replace").rstrip("\r\n")
            if verbose or keep.show(line, fleet_up.is_set()):
                console.line(f"{child.name:>10} | {line}")


def _spawn(name: str, role: str, argv: list[str], env: dict[str, str], children: list[Child], logs: Path,
           console: Console, fleet_up: threading.Event, verbose: bool, seen: Seen) -> Child:
    log = open(rotate(logs / f"{name}.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "skyline.cli", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C goes to us; we stop children in order
        preexec_fn=parent_death_signal(signal.SIGTERM),  # and if we die, SIGKILL included, they stop too
    )
    child = Child(name, role, proc, Path(log.name), argv=tuple(argv))
    children.append(child)
    console.line(f"{name:>10} | starting, pid {proc.pid}")
    child.relay = threading.Thread(target=_relay, args=(child, log, console, fleet_up, verbose, seen),
                                   daemon=True)
    child.relay.start()
    return child


def _common_args(cfg: SkylineConfig, args: argparse.Namespace) -> list[str]:
    out = ["--redis-url", cfg.redis.url, "--engine", cfg.engine.kind, "--key-prefix", cfg.key_prefix]
    if cfg.default_model:  # the model `up` starts keeps the plain keys, whatever flags named it
        out += ["--default-model", cfg.default_model]
    if args.config:
        out += ["--config", args.config]
    out += ["--log-format", cfg.observability.log_format]
    if cfg.observability.otlp_traces_endpoint:
        out += ["--otlp-traces-endpoint", cfg.observability.otlp_traces_endpoint]
    return out


def _model_args(cfg: SkylineConfig) -> list[str]:
    """The model, its name and context length for the gateway and the batch runner (the workers read them
    from the engine arguments, `engine_argv`, and the config file, as `up` did)."""
    out = ["--max-model-len", str(cfg.engine.max_model_len)]
    if cfg.engine.kind == "vllm":
        out += ["--model", cfg.engine.model]
    if cfg.engine.served_model_name:
        out += ["--served-model-name", cfg.engine.served_model_name]
    return out


def engine_argv(cfg: SkylineConfig, role: str) -> list[str]:
    """The vLLM engine arguments `up` got on its command line for a worker of `role`: those for every engine,
    then its role's (`--<role>-engine-args`); the worker reads the config file's [engine.vllm] tables itself."""
    return [*cfg.engine.vllm.argv, *cfg.engine.vllm.role_argv.get(role, ())]


class StartupFailed(Exception):
    def __init__(self, child: Child):
        super().__init__(f"{child.name} exited with code {child.proc.returncode} during start-up")
        self.child = child


def _wait_ready(url: str, children: list[Child], batch_registered: Callable[[], bool], console: Console,
                logs: Path, timeout_s: float) -> None:
    """Until every child is ready; says "ready" for each as it gets there and spins meanwhile."""
    t0 = time.monotonic()
    next_probe = t0
    while time.monotonic() < t0 + timeout_s:
        for child in children:
            if child.proc.poll() is not None:
                raise StartupFailed(child)
        if time.monotonic() >= next_probe:  # probe twice a second, spin ten times
            _mark_ready(url, children, batch_registered, console)
            next_probe = time.monotonic() + 0.5
        waiting = [c.name for c in children if not c.ready]
        if not waiting:
            return
        console.spin(f"waiting for {', '.join(waiting)}  ({time.monotonic() - t0:.0f}s; logs: {logs})")
        time.sleep(0.1)
    raise TimeoutError(f"not ready after {timeout_s:.0f}s: {', '.join(c.name for c in children if not c.ready)}")


def _mark_ready(url: str, children: list[Child], batch_registered: Callable[[], bool], console: Console) -> None:
    # The gateway is ready when /health answers 200; a worker when /health counts it. /health
    # counts workers per role, not by name: with n of a role counted, the first n started are
    # called ready (the line says "n of N" so the count is what it claims).
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            workers: dict[str, int] | None = json.loads(resp.read()).get("workers", {})
    except (OSError, ValueError):
        workers = None
    for child in children:
        if child.ready:
            continue
        same_role = [c for c in children if c.role == child.role]
        if child.role == "gateway":
            child.ready, why = workers is not None, "/health answers"
        elif child.role == "batch":
            child.ready, why = batch_registered(), "registered with RQ, waiting for batch jobs"
        else:
            counted = (workers or {}).get(child.role, 0)
            child.ready = same_role.index(child) < counted
            why = f"/health counts {min(counted, len(same_role))} of {len(same_role)} {child.role} workers"
        if child.ready:
            console.line(f"{child.name:>10} | ready: {why}")


def _rq_registered(cfg: SkylineConfig, name: str) -> Callable[[], bool]:
    """Whether the batch runner's RQ worker `name` has registered in Redis: it has no /health."""
    from redis.exceptions import RedisError
    from rq import Worker

    from skyline.batch.jobs import rq_connection

    def registered() -> bool:
        try:
            with rq_connection(cfg.redis) as conn:
                return bool(conn.exists(Worker.redis_worker_namespace_prefix + name))
        except (RedisError, OSError, ValueError):
            return False

    return registered


def fleet_password(home: Path) -> str:
    """The local fleet's Redis password: made once, kept in $SKYLINE_HOME (mode 0600)."""
    return _local_secret(home / "redis-fleet.password")


def local_operator_key(home: Path) -> str:
    """An operator key for a fleet whose keys are all tenants': its batch runner runs every tenant's
    batches, and the dashboard needs one. Made once, kept in $SKYLINE_HOME (mode 0600)."""
    return _local_secret(home / "operator.key", prefix="sk-operator-")


def _local_secret(path: Path, prefix: str = "") -> str:
    home = path.parent
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(prefix + secrets.token_urlsafe(24))
    return path.read_text().strip()


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def _stopping() -> None:
    # Once stopping, a second Ctrl-C (an impatient user; `timeout` forwarding its SIGINT to the
    # group) must not break off the orderly stop: that would leave Redis running with a traceback.
    # _stop_all ends within its bounds anyway (then SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


DEFAULT_ELASTIC = 2  # the default fleet: two elastic workers (this machine kind's two cores, one each)


def resolve_pools(args: argparse.Namespace) -> None:
    """The fleet's workers from `--elastic`, `--prefill`, `--decode`: two elastic workers unless a
    pool is pinned (then 1 prefill and 1 decode worker unless said otherwise, and no elastic one)."""
    pinned = args.prefill is not None or args.decode is not None
    args.elastic = args.elastic if args.elastic is not None else (0 if pinned else DEFAULT_ELASTIC)
    args.prefill = args.prefill if args.prefill is not None else (1 if pinned else 0)
    args.decode = args.decode if args.decode is not None else (1 if pinned else 0)


def up(cfg: SkylineConfig, args: argparse.Namespace) -> int:
    # Ctrl-C and SIGTERM both stop the fleet, also when `up` was started in the
    # background by a shell (which starts it with SIGINT ignored).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    home = skyline_home()
    logs = home / "logs"
    verbose = getattr(args, "verbose", False)
    resolve_pools(args)
    console = Console()
    fleet_up = threading.Event()  # set at the banner: from then on the terminal also gets Skyline's INFO lines
    children: list[Child] = []
    redis_proc = None
    console.line(f"skyline up: each process logs to {logs}/<name>.log"
                 + ("" if verbose else "; here: progress, warnings, errors (--verbose: everything)"))
    taken = taken_ports(cfg, args)
    if taken:  # found before anything starts: nothing to stop, no engine left behind
        for what, port, holder in taken:
            console.line(f"skyline up: port {port} ({what}) is taken by {holder}")
        console.line("skyline up: stop that process, or choose other ports (--port, --redis-port, "
                     "--metrics-port-base); nothing was started")
        return 1
    try:  # from here: a Ctrl-C, even during the first run's model preparation, stops what started
        if not args.redis_url and not envs.REDIS_URL.is_set():
            # The fleet connects as a restricted ACL user (no admin commands); the
            # default user stays for an operator's `redis-cli` on this machine only.
            password = fleet_password(home)
            redis_proc = start_redis(args.redis_port, home / "redis", args.redis_persistence,
                                     rotate(logs / "redis.log"), fleet_password=password,
                                     own_session=True, end_with_parent=True)  # stopped last, below
            cfg = replace(cfg, redis=replace(cfg.redis, url=f"redis://{FLEET_USER}:@127.0.0.1:{args.redis_port}/0",
                                             password=password))  # children: the URL and the environment
            os.environ[envs.REDIS_PASSWORD.name] = password  # children inherit it; never on a command line
            console.line(f"{'redis':>10} | ready: 127.0.0.1:{args.redis_port}, pid {redis_proc.pid}")
        if cfg.engine.kind == "vllm":
            from skyline.tools.model import resolve_model

            console.line(f"model: {resolve_model(cfg.engine.model)}")  # prepares the default model once
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cfg.gateway.api_keys:  # in the environment, not on command lines, where `ps` shows them to everyone
            env[envs.API_KEYS.name] = ",".join(cfg.gateway.api_keys)
        if cfg.gateway.api_keys and not cfg.gateway.operator_api_keys:
            cfg = replace(cfg, gateway=replace(cfg.gateway, operator_api_keys=(local_operator_key(home),)))
            console.line(f"operator key (the dashboard, the batch runner): in {home / 'operator.key'}")
        if cfg.gateway.operator_api_keys:  # the gateway's, and the batch runner's (it runs every tenant's batches)
            env[envs.OPERATOR_API_KEYS.name] = ",".join(cfg.gateway.operator_api_keys)
        common = _common_args(cfg, args)
        seen = Seen()  # the warnings already shown, fleet-wide
        spawn = lambda name, role, argv: _spawn(name, role, argv, env, children, logs,  # noqa: E731
                                                console, fleet_up, verbose, seen)
        # The gateway gets the command line's vLLM arguments: its serving-layer ones (the config file's
        # [gateway] vllm_args it reads itself: passed here too, an appending flag such as --middleware would
        # count twice) and every engine's, so that it checks requests as those engines would.
        gw = ["gateway", *common, *_model_args(cfg), "--host", args.host, "--port", str(args.port), "--mode", cfg.gateway.mode,
              *_openai_surface_args(cfg), *getattr(args, "frontend_argv", ()), *cfg.engine.vllm.argv]
        t0 = time.monotonic()
        spawn("gateway", "gateway", gw)
        plan = plan_workers(cfg, args.prefill, args.decode, args.metrics_port_base, args.elastic)
        for name, extra in plan:
            # The command line's engine arguments are the default model's; a [[models]] table's workers read
            # theirs from the config (--config-model).
            own = engine_argv(cfg, extra[0]) if "--config-model" not in extra else []
            spawn(name, extra[0], ["worker", extra[0], *common, *extra[1:], *own])
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        # One batch runner (an RQ worker) runs batch jobs through this gateway (docs/batch.md).
        runner = f"batch-runner-{socket.gethostname()}-{os.getpid()}"
        spawn("batch", "batch", ["batch-runner", *common, *_model_args(cfg), "--gateway-url", url, "--name", runner])
        try:
            _wait_ready(url, children, _rq_registered(cfg, runner), console, logs, timeout_s=600)
        except StartupFailed as exc:
            console.done()
            _show_death(exc.child, console, verbose)
            console.line("skyline up: stopping the fleet")
            return 1
        except TimeoutError as exc:
            console.done()
            console.line(f"skyline up: {exc}; their logs are in {logs}. Stopping the fleet")
            return 1
        console.done()
        _banner(cfg, url, time.monotonic() - t0, plan, logs, console)
        fleet_up.set()
        exits: dict[str, list[float]] = {}
        while True:
            time.sleep(0.5)
            dead = [c for c in children if c.proc.poll() is not None]
            now = time.monotonic()
            for child in dead:
                exits[child.name] = [t for t in exits.get(child.name, []) if now - t < RESTART_WINDOW_S] + [now]
            restart = [c for c in dead if c.role in WORKER_ROLES and len(exits[c.name]) <= MAX_RESTARTS]
            if len(restart) < len(dead):
                break
            for child in restart:
                _show_death(child, console, verbose)
                _end_group(child)
                children.remove(child)
                console.line(f"skyline up: restarting {child.name} (exit {child.proc.returncode}; "
                             f"{len(exits[child.name])} of at most {MAX_RESTARTS} in {RESTART_WINDOW_S / 60:.0f} min); "
                             f"live {child.role} workers take over what it held")
                spawn(child.name, child.role, list(child.argv))
        for child in dead:
            _show_death(child, console, verbose)
        console.line(f"skyline up: {', '.join(f'{c.name} (exit {c.proc.returncode})' for c in dead)} stopped; "
                     "shutting down the fleet")
        return 1
    except KeyboardInterrupt:
        _stopping()
        console.done()
        console.line("\nskyline up: stopping...")
        return 0
    finally:
        _stopping()
        _stop_all(children, cfg.worker.drain_timeout_s)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)


def taken_ports(cfg: SkylineConfig, args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(what, port, who holds it) for each port the fleet would listen on that is taken now."""
    wanted = [("the gateway", args.host, args.port)]
    if not args.redis_url and not envs.REDIS_URL.is_set():
        wanted.append(("Redis", "127.0.0.1", args.redis_port))
    for name, extra in plan_workers(cfg, args.prefill, args.decode, args.metrics_port_base, args.elastic):
        if "--metrics-port" in extra:
            wanted.append((f"{name}'s metrics", "0.0.0.0", int(extra[extra.index("--metrics-port") + 1])))
    return [(what, port, port_holder(port)) for what, host, port in wanted if port and port_taken(host, port)]


def _end_group(child: Child) -> None:
    """SIGKILL what is left of an ended child's process group: its vLLM engine processes, if the
    child died before they could learn it (they end with it on their own: skyline/core/lifetime.py)."""
    try:
        os.killpg(child.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def _show_death(child: Child, console: Console, verbose: bool) -> None:
    """What a process that died printed last (already on the terminal with --verbose) and where its log is."""
    if child.relay is not None:
        child.relay.join(timeout=2)  # its last lines reach the file first
    console.line(f"skyline up: {child.name} exited with code {child.proc.returncode}; its log: {child.log}")
    if not verbose:
        console.line("\n".join(f"{child.name:>10} | {line}" for line in tail(child.log)))


def _stop_all(children: list[Child], drain_timeout_s: float) -> None:
    # Workers first (they drain and deregister), the gateway last. A worker may take its drain
    # bound and then some (workers/runtime.py ends itself past that, logging where it hung);
    # only what outlives that gets SIGKILL, and the terminal says so. The gateway gets the same
    # bound: it refuses new requests at once, and the streams the workers are draining reach
    # their clients through it until the workers are done.
    for child in sorted(children, key=lambda c: c.role == "gateway"):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    for child in children:
        limit_s = 30.0 if child.role == "batch" else drain_timeout_s + 60
        try:
            child.proc.wait(timeout=max(0.1, t0 + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"skyline up: {child.name} did not stop within {limit_s:.0f} s of SIGTERM; killing it "
                  f"(its log: {child.log})", file=sys.stderr, flush=True)
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        _end_group(child)
    for child in children:  # their last lines (how they stopped) reach their log files
        if child.relay is not None:
            child.relay.join(timeout=2)


def _banner(cfg: SkylineConfig, url: str, took_s: float, plan: list[tuple[str, list[str]]], logs: Path,
            console: Console) -> None:
    # The fleet connects as the restricted ACL user; an operator on this machine uses the default user.
    admin_url = cfg.redis.url.replace(f"{FLEET_USER}:@", "")
    from skyline.tools.model import model_identity

    _, model = model_identity(cfg)  # the default model is already prepared by now: cheap
    others = [m.config_model for m in fleet_models(cfg, 0, 0)[1:]]
    models = f"\n  models    {model} (the default), {', '.join(others)}   ([[models]] in the config)" if others else ""
    auth = f' -H "Authorization: Bearer {cfg.gateway.api_keys[0]}"' if cfg.gateway.api_keys else ""
    console.line(
        f"""
Skyline is up ({took_s:.0f}s): {cfg.gateway.mode} mode, engine {cfg.engine.kind}{models}
  gateway   {url}   (OpenAI API: {url}/v1)
  redis     {admin_url}   (redis-cli -u {admin_url} ...)
  status    skyline status --redis-url {admin_url}
  dashboard {url}/dashboard
  metrics   {url}/metrics{_worker_metrics(plan)}
  trace     skyline trace <request id> --redis-url {admin_url}
  batches   skyline batch submit FILE.jsonl --gateway-url {url}   (one batch runner is running; rq info -u {admin_url})
  logs      {logs}/   (one <name>.log per process, the previous start's as <name>.log.1)

Try it:
  curl {url}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'

Ctrl-C stops everything. Below: the request log, warnings and errors.""",
    )


def _worker_metrics(plan: list[tuple[str, list[str]]]) -> str:
    """The workers' /metrics URLs, one per line under the gateway's."""
    lines = []
    for name, args in plan:
        if "--metrics-port" in args:
            lines.append(f"\n            http://127.0.0.1:{args[args.index('--metrics-port') + 1]}/metrics  ({name})")
    return "".join(lines)
