"""The systems under test, and starting/stopping them as processes.

Only one system runs at a time, and every real-engine system is given the
same cores (all of this process's CPU affinity), so the comparison is
between ways of using the same hardware:
  vllm-fcfs          plain vLLM OpenAI server, one engine, FCFS (the baseline)
  vllm-priority      the same server with --scheduling-policy priority
  skyline-colocated  Skyline gateway + Redis + one decode worker that also prefills
  skyline-disagg     Skyline gateway + Redis + 1 prefill worker + 1 decode worker
  vllm-rr            N plain vLLM servers, one core each, behind a round-robin proxy (rrproxy.py)
  skyline-affinity   Skyline gateway + Redis + N colocated decode workers, one core each (prefix affinity)
  skyline-no-affinity  the same with [gateway] prefix_affinity = false
  skyline-disagg-affinity     skyline-disagg (1 prefill + 1 decode worker) for the multi-turn workload
  skyline-disagg-no-affinity  the same with [gateway] prefix_affinity = false
  vllm-lora-rr       vllm-rr's N servers, each `--enable-lora --max-loras 2 --lora-modules` the workload's adapters
  skyline-lora-aware N colocated decode workers with --enable-lora --max-loras 2, the adapters loaded through
                     the gateway; adapter-aware placement on (the default)
  skyline-lora-blind the same with [gateway] adapter_affinity = false
  sim-colocated / sim-disagg / sim-affinity / sim-no-affinity / sim-disagg-affinity / sim-disagg-no-affinity /
  sim-lora-aware / sim-lora-blind
                     the Skyline fleets on the `sim` engine (tests)
  endpoint           an already running OpenAI-compatible server (--endpoint)
The N-engine systems (N = `engines`, the bench's --engines) compare N prefix caches placed by
prefix with N caches placed blindly, on the same N cores.
Process output goes to <out>/logs/<system>-<process>.log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from skyline.core.net import free_port
from skyline.tools.bench import lora
from skyline.tools.bench.config_file import with_changes
from skyline.tools.redis_server import start_redis

VLLM_MAX_MODEL_LEN = 2048  # Skyline's default context; both sides must agree
VLLM_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE; Skyline's default kv_cache_gib per engine is the same
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's KV block on CPU: its prefix cache holds whole blocks of this many tokens
DEFAULT_ENGINES = 2  # engines of the N-engine systems: this machine's 2 cores, one each


@dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: str  # "vllm" | "skyline" | "endpoint"
    flavor: str  # request shaping, see skyline.tools.bench.shaping
    engine: str = "vllm"  # skyline fleets: "vllm" | "sim"
    mode: str = ""  # skyline fleets: "colocated" | "disagg"
    scheduling: str = "fcfs"  # vllm server: "fcfs" | "priority"
    # Engines, one core each (vLLM servers behind the round-robin proxy, or Skyline decode workers);
    # 1 = the classic systems: one engine on every core (a disagg fleet: 1 prefill + 1 decode).
    engines: int = 1
    affinity: bool = True  # skyline fleets: [gateway] prefix_affinity
    block_size: int = 0  # vLLM engines' KV block (--block-size, [engine.vllm] block-size); 0 = vLLM's default
    elastic: int = 0  # skyline fleets: elastic workers instead of prefill + decode pools (one core each)
    lora: bool = False  # engines with LoRA serving the workload's adapters (skyline.tools.bench.lora)
    adapter_affinity: bool = True  # skyline fleets: [gateway] adapter_affinity (adapter-aware placement)


SYSTEMS: dict[str, SystemSpec] = {s.name: s for s in (
    SystemSpec("vllm-fcfs", "vllm", "plain"),
    SystemSpec("vllm-priority", "vllm", "priority", scheduling="priority"),
    SystemSpec("skyline-colocated", "skyline", "skyline", mode="colocated"),
    SystemSpec("skyline-disagg", "skyline", "skyline", mode="disagg"),
    SystemSpec("sim-colocated", "skyline", "skyline", engine="sim", mode="colocated"),
    SystemSpec("sim-disagg", "skyline", "skyline", engine="sim", mode="disagg"),
    SystemSpec("vllm-rr", "vllm", "plain", engines=DEFAULT_ENGINES),
    SystemSpec("skyline-affinity", "skyline", "skyline", mode="colocated", engines=DEFAULT_ENGINES),
    SystemSpec("skyline-no-affinity", "skyline", "skyline", mode="colocated", engines=DEFAULT_ENGINES,
               affinity=False),
    SystemSpec("sim-affinity", "skyline", "skyline", engine="sim", mode="colocated", engines=DEFAULT_ENGINES),
    SystemSpec("sim-no-affinity", "skyline", "skyline", engine="sim", mode="colocated", engines=DEFAULT_ENGINES,
               affinity=False),
    # Disaggregated, 1 prefill + 1 decode worker (engines=1: --engines leaves them so). With one decode
    # worker nothing is placed, so the pair differs in the route (issue 21 item 4: a turn whose history
    # the decode worker holds skips the prefill pool; with affinity off the gateway reads no cache view
    # and routes on prompt length, tests/test_bench_e2e_multiturn_disagg.py).
    SystemSpec("skyline-disagg-affinity", "skyline", "skyline", mode="disagg"),
    SystemSpec("skyline-disagg-no-affinity", "skyline", "skyline", mode="disagg", affinity=False),
    SystemSpec("sim-disagg-affinity", "skyline", "skyline", engine="sim", mode="disagg"),
    SystemSpec("sim-disagg-no-affinity", "skyline", "skyline", engine="sim", mode="disagg", affinity=False),
    # Two elastic workers, one core each: every engine takes either phase (scheduler/elastic.py).
    SystemSpec("skyline-elastic", "skyline", "skyline", mode="disagg", elastic=DEFAULT_ENGINES),
    SystemSpec("sim-elastic", "skyline", "skyline", engine="sim", mode="disagg", elastic=DEFAULT_ENGINES),
    # The multi-LoRA workload: N engines, one core each, MAX_LORAS adapter slots each.
    SystemSpec("vllm-lora-rr", "vllm", "plain", engines=DEFAULT_ENGINES, lora=True),
    SystemSpec("skyline-lora-aware", "skyline", "skyline", mode="colocated", engines=DEFAULT_ENGINES, lora=True),
    SystemSpec("skyline-lora-blind", "skyline", "skyline", mode="colocated", engines=DEFAULT_ENGINES, lora=True,
               adapter_affinity=False),
    SystemSpec("sim-lora-aware", "skyline", "skyline", engine="sim", mode="colocated", engines=DEFAULT_ENGINES,
               lora=True),
    SystemSpec("sim-lora-blind", "skyline", "skyline", engine="sim", mode="colocated", engines=DEFAULT_ENGINES,
               lora=True, adapter_affinity=False),
)}
DEFAULT_SYSTEMS = ("vllm-fcfs", "vllm-priority", "skyline-colocated", "skyline-disagg")


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cache_block_size(spec: SystemSpec, tokenizer: str = "default") -> int:
    """The block size of a system's prefix cache (the oracle's unit): the sim engine's, else vLLM's on
    CPU. `tokenizer`: an endpoint's --tokenizer ("bytes" = a sim fleet)."""
    from skyline.workers.engines.sim import SIM_BLOCK_SIZE

    sim = spec.engine == "sim" or (spec.kind == "endpoint" and tokenizer == "bytes")
    return SIM_BLOCK_SIZE if sim else spec.block_size or VLLM_CPU_BLOCK_SIZE


def engine_cores() -> str:
    """The cores a one-engine system (vLLM, Skyline colocated) binds its engine to: all of this process's."""
    cores = _cores()
    return f"{cores[0]}-{cores[-1]}"


@dataclass
class Running:
    """A started system: where to send requests, and what to stop afterwards."""

    spec: SystemSpec
    url: str  # base URL, without /v1
    model: str  # the served model name requests must carry
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    redis: subprocess.Popen | None = None
    tmp: tempfile.TemporaryDirectory | None = None
    logs: list[Path] = field(default_factory=list)
    config: str = ""  # TOML file a Skyline system's processes start with ("" = defaults)
    redis_url: str = ""  # a Skyline system's own Redis
    adapters: list[tuple[str, str]] = field(default_factory=list)  # LoRA systems: (name, path) served
    key_prefix: str = "skyline"  # ... and the prefix of its keys (from its config)

    def stop(self) -> None:
        """Workers first (they drain and deregister), then the gateway/server, then Redis."""
        for _name, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _name, p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(timeout=10)
        if self.tmp is not None:
            self.tmp.cleanup()
        self.procs, self.redis, self.tmp = [], None, None

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                log = self.logs[[n for n, _ in self.procs].index(name)]
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"{self.spec.name}: {name} exited with code {p.returncode}\n{tail}")


def _spawn(run: Running, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
    log = log_dir / f"{run.spec.name}-{name}.log"
    with open(log, "wb") as fh:  # the child keeps its own handle
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    run.procs.append((name, proc))
    run.logs.append(log)


def _wait(run: Running, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run.check_alive()
        try:
            if ready():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{run.spec.name} not ready after {timeout_s:.0f}s (logs: {', '.join(map(str, run.logs))})")


def start(spec: SystemSpec, log_dir: Path, timeout_s: float = 600, endpoint: str = "", model: str = "",
          config: str = "", adapters: list[tuple[str, str]] | None = None) -> Running:
    """Start `spec` and return once it serves requests (or raise, having stopped what it started);
    a Skyline system's gateway and workers read `config` (a TOML file) when given; a LoRA system serves
    `adapters` ((name, path) each)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if spec.kind == "endpoint":
        url = endpoint.rstrip("/").removesuffix("/v1")
        if not model:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        return Running(spec, url, model)
    starter = _start_vllm if spec.kind == "vllm" else _start_skyline
    run = Running(spec, "", "", config=config, adapters=list(adapters or []) if spec.lora else [])
    try:
        starter(run, log_dir, timeout_s)
    except BaseException:
        run.stop()
        raise
    return run


def _models_ok(url: str) -> bool:
    return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200


def _start_vllm(run: Running, log_dir: Path, timeout_s: float) -> None:
    """One server on every core; or (engines > 1) one server per core behind the round-robin proxy."""
    from skyline.tools.model import DEFAULT_MODEL_NAME

    run.model = DEFAULT_MODEL_NAME
    if run.spec.engines == 1:
        run.url = _spawn_vllm(run, "server", engine_cores(), log_dir)
        _wait(run, lambda: _models_ok(run.url), timeout_s)
        return
    cores = _cores()
    urls = [_spawn_vllm(run, f"server-{i}", str(cores[i % len(cores)]), log_dir) for i in range(run.spec.engines)]
    for url in urls:  # they start side by side; each must serve before the proxy is worth asking
        _wait(run, lambda url=url: _models_ok(url), timeout_s)
    port = free_port()
    _spawn(run, "proxy", [sys.executable, "-m", "skyline.tools.bench.rrproxy", "--port", str(port), *urls], log_dir)
    run.url = f"http://127.0.0.1:{port}"
    _wait(run, lambda: _models_ok(run.url), timeout_s)


def _spawn_vllm(run: Running, name: str, cores: str, log_dir: Path) -> str:
    """Start one vLLM OpenAI server bound to `cores`; returns its base URL."""
    from skyline.tools.model import DEFAULT_MODEL_NAME, resolve_model
    from skyline.gateway.vllm_serving_internals import API_SERVER_MODULE
    from skyline.workers.engines import engine_processes

    port = free_port()
    argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", resolve_model("default"),
            "--served-model-name", DEFAULT_MODEL_NAME, "--dtype", "float32", "--max-model-len", str(VLLM_MAX_MODEL_LEN),
            "--host", "127.0.0.1", "--port", str(port),
            # Eager mode starts much sooner (nothing compiled) and decodes as fast on CPU.
            "--enforce-eager", "--scheduling-policy", run.spec.scheduling,
            # usage.prompt_tokens_details.cached_tokens: the prefix-cache hits the report counts.
            "--enable-prompt-tokens-details"]
    if run.spec.block_size:
        argv += ["--block-size", str(run.spec.block_size)]
    if run.adapters:  # as vllm serve serves adapters from its start
        argv += [*lora.engine_flags(), "--lora-modules", *(f"{name}={path}" for name, path in run.adapters)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": cores,
           # The CPU fix Skyline's own engines get (engine_processes.py: queue readers that sleep instead of
           # spinning through every step): the baseline gets it too, so the ratios measure the serving layer.
           engine_processes.PAUSE_ENV: engine_processes.POLL_PAUSE_US}
    _spawn(run, name, argv, log_dir, env)
    return f"http://127.0.0.1:{port}"


def _start_skyline(run: Running, log_dir: Path, timeout_s: float) -> None:
    from skyline.core.config import load_config
    from skyline.tools.launcher import plan_workers

    spec = run.spec
    run.tmp = tempfile.TemporaryDirectory(prefix=f"skyline-bench-{spec.name}-")
    rport, gport = free_port(), free_port()
    run.redis = start_redis(rport, Path(run.tmp.name) / "redis")
    run.redis_url = f"redis://127.0.0.1:{rport}/0"
    # The user's config (or the defaults) with the system's own settings: one file every process reads.
    changes: dict = {}
    if not spec.affinity:
        changes["gateway"] = {"prefix_affinity": False}
    if spec.block_size:  # set on vLLM-engine systems only (Bench._systems)
        changes["engine"] = {"vllm": {"block-size": spec.block_size}}
    if spec.lora:
        changes.setdefault("gateway", {})["adapter_affinity"] = spec.adapter_affinity
        if spec.engine == "sim":
            changes.setdefault("engine", {})["sim_max_loras"] = lora.MAX_LORAS
    if changes:
        run.config = with_changes(run.config, changes, Path(run.tmp.name) / "skyline.toml")
    common = ["--redis-url", run.redis_url, "--engine", spec.engine]
    if spec.engine == "vllm":
        common += ["--model", "default"]
    if run.config:
        common += ["--config", run.config]
    cli = [sys.executable, "-m", "skyline.cli"]
    # Same pinning as `skyline up`: colocated = one worker on every core; disagg = prefill core 0, decode core 1;
    # N decode workers (engines > 1) = one core each.
    cfg = load_config(run.config or None, {"engine": {"kind": spec.engine}, "gateway": {"mode": spec.mode}})
    run.key_prefix = cfg.key_prefix
    # Free metrics ports (0), not `skyline up`'s fixed ones: the bench reads each worker's from its heartbeat,
    # and a fixed port collides with any other fleet on the host (two test runs at once: "address in use").
    plan = (plan_workers(cfg, 0, 0, 0, n_elastic=spec.elastic) if spec.elastic
            else plan_workers(cfg, 1, spec.engines, 0))
    engine_lora = lora.engine_flags() if spec.lora and spec.engine == "vllm" else []
    for name, extra in plan:
        _spawn(run, name, [*cli, "worker", extra[0], *common, *extra[1:], *engine_lora], log_dir)
    _spawn(run, "gateway", [*cli, "gateway", *common, "--port", str(gport), "--mode", spec.mode], log_dir)
    # stop() signals in list order: workers were added first, so they drain before the gateway goes.
    run.url = f"http://127.0.0.1:{gport}"
    want = ({"elastic": spec.elastic} if spec.elastic
            else {"decode": spec.engines, **({"prefill": 1} if spec.mode == "disagg" else {})})

    def ready() -> bool:
        workers = httpx.get(f"{run.url}/health", timeout=2).json().get("workers", {})
        return all(workers.get(role, 0) >= n for role, n in want.items())

    _wait(run, ready, timeout_s)
    run.model = httpx.get(f"{run.url}/v1/models", timeout=5).json()["data"][0]["id"]
    for name, path in run.adapters:  # fleet-wide, through the gateway (no API keys here: anyone may load)
        loaded = httpx.post(f"{run.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)
        if loaded.status_code != 200:
            raise RuntimeError(f"{spec.name}: loading adapter {name} from {path}: {loaded.status_code} {loaded.text}")
