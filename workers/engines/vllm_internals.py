"""Every vLLM internal the engine side uses, in one place (the serving side's: gateway/vllm_serving_internals.py).

The rest of `workers/` uses vLLM's public API (`AsyncLLM.from_engine_args/generate/abort`,
`SamplingParams`, `TokensPrompt`, the engine arguments) and, for anything else, the functions and
classes here. Each internal is named once below as an `Internal` (skyline/core/vllm_contract.py):
resolved when it is used, raising `VllmDrift` (the class or method that moved, the supported
vLLM version) instead of patching nothing; tests/test_vllm_contract_engine.py checks every one,
with the parameters, fields and source text relied on, against the installed vLLM.

What is used, and why:
  * the shared-memory queue readers' busy wait (`SpinCondition.wait`) and the NIXL connector
    worker's core pinning (`NixlBaseConnectorWorker.__init__`), patched in the engine processes
    by workers/engines/engine_processes.py; NIXL's binding, for its progress thread's delay;
  * the scheduler classes and the running list, for the step shape (workers/engines/vllm_scheduler.py);
  * the output processor, for the prompt tokens each request loaded through the KV connector
    (`PrefillStats.num_external_cached_tokens`, not copied into `RequestOutput`);
  * the stat logger interface and the scheduler's per-step stats (running, waiting, KV usage,
    each step's tokens and time), and the logger that writes the per-step line;
  * the KV cache events (config, batch and event types), for the prefix cache's view;
  * `AsyncLLM.notify_kv_transfer_request_rejected` and a one-token request to make an idle
    engine take a step (it sends the rejection's notification only at a step);
  * the model config's layer, head and size getters, for the bytes of one token's KV.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skyline.core.vllm_contract import Internal, drift

log = logging.getLogger("skyline.engine.vllm")

# ---- what is used ------------------------------------------------------------------------------

SPIN_CONDITION = Internal(
    "vllm.distributed.device_communicators.shm_broadcast", "SpinCondition",
    "to let the engine processes' shared-memory queue readers sleep in their busy-polling window",
    params=("is_reader", "busy_loop_s"), fields=("is_reader", "last_read", "busy_loop_s"))
SPIN_CONDITION_WAIT = Internal(
    SPIN_CONDITION.module, "SpinCondition.wait", SPIN_CONDITION.used_for,
    params=("self", "timeout_ms"), source=("sched_yield()", "busy_loop_s"))
NIXL_WORKER = Internal(
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "NixlBaseConnectorWorker",
    "to give the engine's computing thread back its cores after the NIXL connector pinned it")
NIXL_WORKER_INIT = Internal(NIXL_WORKER.module, "NixlBaseConnectorWorker.__init__", NIXL_WORKER.used_for,
                            source=("sched_setaffinity(0",))
# NIXL's Python API (the CUDA-major-specific binding behind it), which vLLM's connector builds its agents with.
NIXL_API = Internal("nixl._api", "", "(NIXL's, through vLLM's connector) to set the progress thread's delay")
NIXL_AGENT = Internal(NIXL_API.module, "nixlBind.nixlAgent", NIXL_API.used_for)
NIXL_AGENT_CONFIG = Internal(NIXL_API.module, "nixlBind.nixlAgentConfig", NIXL_API.used_for, fields=("pthrDelay",))
SCHEDULER = Internal(
    "vllm.v1.core.sched.scheduler", "Scheduler",
    "as the base of the step-shaping scheduler, which sets the step budget and holds prompts out of "
    "`running` for one schedule()",
    params=("vllm_config",),
    fields=("running", "waiting", "max_num_scheduled_tokens", "scheduler_config", "lora_config"))
SCHEDULER_SCHEDULE = Internal(
    SCHEDULER.module, "Scheduler.schedule", SCHEDULER.used_for,
    source=("self.running", "self.max_num_scheduled_tokens", "long_prefill_token_threshold",
            "self.lora_config.max_loras", "lora_request.lora_int_id"))
ASYNC_SCHEDULER = Internal("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", SCHEDULER.used_for)
SCHEDULED_REQUEST = Internal(
    "vllm.v1.request", "Request", "for what the step-shaping scheduler reads of each request it holds",
    fields=("num_prompt_tokens", "num_computed_tokens", "priority", "status", "sampling_params", "lora_request"))
WAITING_FOR_REMOTE_KVS = Internal(
    "vllm.v1.request", "RequestStatus.WAITING_FOR_REMOTE_KVS",
    "to leave out of the step shape a request that waits for its KV from a prefill engine")
ASYNC_LLM = Internal(
    "vllm.v1.engine.async_llm", "AsyncLLM", "for its output processor, stat loggers and KV rejections",
    fields=("output_processor", "vllm_config", "model_config", "errored"))
FROM_ENGINE_ARGS = Internal(ASYNC_LLM.module, "AsyncLLM.from_engine_args", "with Skyline's stat logger",
                            params=("engine_args", "stat_loggers"))
REJECT_KV = Internal(
    ASYNC_LLM.module, "AsyncLLM.notify_kv_transfer_request_rejected",
    "to tell a prefill engine that its blocks will not be read", params=("request_id", "kv_transfer_params"))
PROCESS_OUTPUTS = Internal(
    "vllm.v1.engine.output_processor", "OutputProcessor.process_outputs",
    "to read how many prompt tokens each request loaded through the KV connector",
    params=("engine_core_outputs",))
OUTPUT_PROCESSOR = Internal("vllm.v1.engine.output_processor", "OutputProcessor", PROCESS_OUTPUTS.used_for,
                            fields=("request_states",))
REQUEST_STATE = Internal("vllm.v1.engine.output_processor", "RequestState", PROCESS_OUTPUTS.used_for,
                         params=("external_req_id",), fields=("external_req_id",))
ENGINE_CORE_OUTPUT = Internal("vllm.v1.engine", "EngineCoreOutput", PROCESS_OUTPUTS.used_for,
                              fields=("request_id", "prefill_stats"))
PREFILL_STATS = Internal("vllm.v1.metrics.stats", "PrefillStats", PROCESS_OUTPUTS.used_for,
                         fields=("num_external_cached_tokens",))
STAT_LOGGER = Internal(
    "vllm.v1.metrics.loggers", "StatLoggerBase", "for each step's scheduler stats (the worker's load and steps)",
    params=("vllm_config", "engine_index"))
STAT_LOGGER_RECORD = Internal(
    STAT_LOGGER.module, "StatLoggerBase.record", STAT_LOGGER.used_for,
    params=("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"))
STAT_LOGGER_INITIALIZED = Internal(STAT_LOGGER.module, "StatLoggerBase.log_engine_initialized", STAT_LOGGER.used_for)
SCHEDULER_STATS = Internal(
    "vllm.v1.metrics.stats", "SchedulerStats", STAT_LOGGER.used_for,
    fields=("num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs", "kv_cache_usage", "iteration_details"))
ITERATION_DETAILS = Internal(
    "vllm.v1.metrics.stats", "SchedulerIterationDetails", STAT_LOGGER.used_for,
    fields=("num_ctx_tokens", "num_generation_tokens", "elapsed_ms", "is_dummy"))
# The per-step INFO line vLLM logs with iteration details on ("%sIteration(%d): ..."), dropped from the log.
ITERATION_LINE_LOGGER = Internal(STAT_LOGGER.module, "", "to drop its per-step log line",
                                 source=('"%sIteration(',))
KV_EVENTS_CONFIG = Internal(
    "vllm.config", "KVEventsConfig", "to make the engine publish its prefix cache's events",
    fields=("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "topic"))
KV_EVENT_BATCH = Internal("vllm.distributed.kv_events", "KVEventBatch", "to decode the engine's KV cache events",
                          fields=("events",))
BLOCK_STORED = Internal(
    "vllm.distributed.kv_events", "BlockStored", KV_EVENT_BATCH.used_for,
    fields=("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "extra_keys", "medium",
            "group_idx"))
BLOCK_REMOVED = Internal("vllm.distributed.kv_events", "BlockRemoved", KV_EVENT_BATCH.used_for,
                         fields=("block_hashes", "medium", "group_idx"))
ALL_BLOCKS_CLEARED = Internal("vllm.distributed.kv_events", "AllBlocksCleared", KV_EVENT_BATCH.used_for)
MODEL_CONFIG_SHAPE = tuple(
    Internal("vllm.config", f"ModelConfig.{name}", "to size one token's KV (K and V, every layer)", params=params)
    for name, params in (("get_num_layers", ("parallel_config",)), ("get_num_kv_heads", ("parallel_config",)),
                         ("get_head_size", ())))

CONTRACT: tuple[Internal, ...] = (
    SPIN_CONDITION, SPIN_CONDITION_WAIT, NIXL_WORKER, NIXL_WORKER_INIT, NIXL_API, NIXL_AGENT, NIXL_AGENT_CONFIG,
    SCHEDULER, SCHEDULER_SCHEDULE,
    ASYNC_SCHEDULER, SCHEDULED_REQUEST, WAITING_FOR_REMOTE_KVS, ASYNC_LLM, FROM_ENGINE_ARGS, REJECT_KV,
    PROCESS_OUTPUTS, OUTPUT_PROCESSOR, REQUEST_STATE, ENGINE_CORE_OUTPUT, PREFILL_STATS, STAT_LOGGER,
    STAT_LOGGER_RECORD, STAT_LOGGER_INITIALIZED, SCHEDULER_STATS, ITERATION_DETAILS, ITERATION_LINE_LOGGER,
    KV_EVENTS_CONFIG, KV_EVENT_BATCH, BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED, *MODEL_CONFIG_SHAPE,
)

# ---- engine processes (loaded there by workers/engines/engine_processes.py) --------------------


def keep_cores_while_nixl_worker_builds() -> None:
    """vLLM's NIXL connector worker leaves the thread that builds it on the cores it had."""
    NIXL_WORKER_INIT.resolve()
    keep_thread_cores(NIXL_WORKER.resolve())


def pause_shm_queue_readers(pause_s: float) -> None:
    """vLLM's shared-memory queue readers sleep `pause_s` per look in their busy-polling window."""
    SPIN_CONDITION_WAIT.resolve()
    pause_between_polls(SPIN_CONDITION.resolve(), pause_s)


def delay_nixl_progress_thread(delay_us: int) -> None:
    """Every NIXL agent built in this process pauses `delay_us` between its progress thread's polls."""
    api = NIXL_API.resolve()
    NIXL_AGENT.resolve()
    real = api.nixlBind
    if getattr(real, "_skyline_delay", None) is not None:
        return  # already patched in this process
    api.nixlBind = _DelayedBind(real, delay_us)


def keep_thread_cores(cls: type) -> None:
    """Building a `cls` leaves the building thread on the cores it had (patched once per class)."""
    if cls.__dict__.get("_skyline_keeps_cores"):
        return
    real_init = cls.__init__

    def __init__(self, *args, **kwargs):
        cores = os.sched_getaffinity(0)  # this thread's: the engine's OpenMP binding
        try:
            real_init(self, *args, **kwargs)
        finally:
            os.sched_setaffinity(0, cores)

    cls.__init__ = __init__
    cls._skyline_keeps_cores = True


def pause_between_polls(cls: type, pause_s: float) -> None:
    """A reader of `cls` (vLLM's SpinCondition) in its busy-polling window sleeps `pause_s` per look
    instead of yielding the core and coming straight back; past the window vLLM's own wait runs."""
    if cls.__dict__.get("_skyline_pause_s") is not None:
        return
    real_wait = cls.wait

    def wait(self, timeout_ms=None):
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(pause_s)
            return
        real_wait(self, timeout_ms)

    cls.wait = wait
    cls._skyline_pause_s = pause_s


class _DelayedBind:
    """The NIXL binding module with `nixlAgent` setting the progress-thread delay."""

    def __init__(self, real, delay_us: int):
        self._real = real
        self._skyline_delay = delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - mirrors the binding's name
        config.pthrDelay = self._skyline_delay
        return self._real.nixlAgent(name, config)


# ---- the scheduler -----------------------------------------------------------------------------


def scheduler_classes() -> tuple[type, type]:
    """vLLM's scheduler classes: (synchronous, async scheduling), to subclass."""
    SCHEDULER_SCHEDULE.resolve()
    return SCHEDULER.resolve(), ASYNC_SCHEDULER.resolve()


# The key, in a request's SamplingParams.extra_args, that marks a request that asked for no SLO (VllmEngine
# sets it; the step-shaping scheduler reads it). extra_args is vLLM's free-form field for such plugins.
BEST_EFFORT_ARG = "skyline_best_effort"


def asked_for_no_slo(request: Any) -> bool:
    """Whether a request the scheduler holds asked for no SLO (no latency targets: best effort)."""
    params = request.sampling_params
    return bool(params is not None and params.extra_args and params.extra_args.get(BEST_EFFORT_ARG))


def waits_for_remote_kv(request: Any) -> bool:
    """Whether a waiting request waits for its KV from a prefill engine (it computes almost nothing here)."""
    return request.status == _waiting_for_remote_kvs()


@functools.cache
def _waiting_for_remote_kvs() -> Any:
    return WAITING_FOR_REMOTE_KVS.resolve()


def set_step_shape(scheduler: Any, tokens: int, prefill_cap: int) -> None:
    """The budget and per-request prompt cap of the scheduler's next schedule() (vLLM reads both afresh
    at every call; the scheduler's config must be its own copy: see `own_scheduler_config`)."""
    scheduler.max_num_scheduled_tokens = tokens
    scheduler.scheduler_config.long_prefill_token_threshold = prefill_cap


def own_scheduler_config(scheduler: Any) -> None:
    """Give the scheduler its own copy of its config (the prompt cap is rewritten every step, and the
    config object is shared with the rest of the engine)."""
    scheduler.scheduler_config = copy.copy(scheduler.scheduler_config)


def decodes_first(scheduler: Any) -> None:
    """vLLM takes running requests in list order: decoding ones first (stable, so prompts keep theirs)."""
    scheduler.running.sort(key=lambda r: r.num_computed_tokens < r.num_prompt_tokens)


def hold_out_of_running(scheduler: Any, held: list[Any]) -> Callable[[], None]:
    """Take `held` out of the running list (vLLM then neither gives them tokens nor sees them as
    running; they keep their blocks and their LoRA slots); returns what puts them back in front of the list.

    vLLM admits a waiting request with a new adapter only while the adapters of the step's scheduled
    running requests are fewer than `max_loras`, and asserts at the next step that the running ones'
    adapters fit. A held request's adapter is not among the scheduled: without the slots it keeps
    taken out of `max_loras` for this step, vLLM admits one adapter too many and its engine core dies
    at the next step's assertion (seen: three adapters on two slots in the LoRA benchmark)."""
    if not held:
        return lambda: None
    ids = {id(r) for r in held}
    scheduler.running = [r for r in scheduler.running if id(r) not in ids]
    lora_config = scheduler.lora_config
    kept = _adapter_ids(held) - _adapter_ids(scheduler.running) if lora_config is not None else set()
    if kept:
        scheduler.lora_config = _FewerLoraSlots(lora_config, max(0, lora_config.max_loras - len(kept)))

    def put_back() -> None:
        scheduler.running[:0] = held
        scheduler.lora_config = lora_config

    return put_back


def _adapter_ids(requests: list[Any]) -> set[int]:
    return {r.lora_request.lora_int_id for r in requests if r.lora_request and r.lora_request.lora_int_id > 0}


class _FewerLoraSlots:
    """vLLM's LoRA config as the scheduler reads it for one schedule(): fewer slots, the rest as it is
    (a stand-in, not a copy: the config validates `max_loras >= 1`, and all slots may be held)."""

    def __init__(self, config: Any, max_loras: int):
        self._config = config
        self.max_loras = max_loras

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


# ---- the engine in the worker's process --------------------------------------------------------


def tap_connector_tokens(llm: Any, remote: dict[str, int]) -> None:
    """Record in `remote`, by the request's external id, how many prompt tokens the engine loaded
    through the KV connector (vLLM's `PrefillStats.num_external_cached_tokens` on the engine core's
    output, which it does not copy into `RequestOutput`): the output processor of `llm` is patched."""
    proc = getattr(llm, "output_processor", None)
    original = getattr(proc, "process_outputs", None)
    if original is None:
        raise drift("AsyncLLM.output_processor.process_outputs", "not found on the engine", PROCESS_OUTPUTS.used_for)

    def process_outputs(engine_core_outputs, *args, **kwargs):
        for eco in engine_core_outputs:
            ps = eco.prefill_stats
            n = ps.num_external_cached_tokens if ps is not None else 0
            if n:
                state = proc.request_states.get(eco.request_id)
                if state is not None:
                    remote[state.external_req_id] = n
        return original(engine_core_outputs, *args, **kwargs)

    proc.process_outputs = process_outputs


@dataclass(frozen=True)
class StepReport:
    """What vLLM's scheduler stats say after one engine step."""

    running: int
    waiting: int  # waiting and skipped-waiting requests
    kv_usage: float
    # The step itself (vLLM's iteration details; None when it reported none or ran a dummy step):
    prompt_tokens: int = 0
    decode_tokens: int = 0
    elapsed_ms: float = 0.0
    has_step: bool = False


def stat_logger_factory(on_report: Callable[[StepReport], None]) -> Callable[..., Any]:
    """A stat logger factory for `AsyncLLM.from_engine_args(stat_loggers=[...])` that hands every
    step's scheduler stats to `on_report`."""
    base = STAT_LOGGER.resolve()

    class _Tap(base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                on_report(step_report(scheduler_stats))

        def log_engine_initialized(self):
            pass

    return _Tap


def step_report(s: Any) -> StepReport:
    step = s.iteration_details  # set when the engine runs with enable_logging_iteration_details
    report = StepReport(running=int(s.num_running_reqs), waiting=int(s.num_waiting_reqs + s.num_skipped_waiting_reqs),
                        kv_usage=float(s.kv_cache_usage))
    if step is None or step.is_dummy:
        return report
    return StepReport(report.running, report.waiting, report.kv_usage, step.num_ctx_tokens,
                      step.num_generation_tokens, step.elapsed_ms, has_step=True)


class _NoIterationLines(logging.Filter):
    """Drops vLLM's per-step "Iteration(n): ..." INFO line: the step details are enabled for the
    worker's metrics (several steps a second), not for the log; vLLM's periodic stats still log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("%sIteration(")


def quiet_iteration_lines() -> None:
    target = logging.getLogger(ITERATION_LINE_LOGGER.module)
    if not any(isinstance(f, _NoIterationLines) for f in target.filters):
        target.addFilter(_NoIterationLines())


def prefix_cache_block_size(llm: Any) -> int:
    """The engine's prefix-cache block size in tokens; 0 when it caches no prefixes (vLLM may turn
    prefix caching off, e.g. for MLA models on CPU)."""
    cc = llm.vllm_config.cache_config
    return int(cc.block_size) if cc.enable_prefix_caching else 0


async def reject_kv_transfer(llm: Any, request_id: str, handle: dict[str, Any]) -> None:
    """vLLM's own path for a hand-off its decode side refuses: a request submitted already aborted,
    whose connector tells the prefill engine (over NIXL, notification only) its blocks will not be read."""
    await llm.notify_kv_transfer_request_rejected(request_id, handle)


async def take_one_step(llm: Any, request_id: str) -> None:
    """Make an idle engine take a step: a one-token request of one token (what it computes is thrown
    away). vLLM sends some connector notifications only at a step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    async for _ in llm.generate(TokensPrompt(prompt_token_ids=[0]), params, request_id):
        pass


def kv_bytes_per_token(llm: Any) -> int | None:
    """K and V of one token across all layers of this engine's shard, in bytes (None if unknown).

    Optional by design, the one internal here that is: the bytes only size KV transfers in the
    timeline, so a model config without these getters is logged and the engine runs on."""
    try:
        import torch

        mc, pc = llm.model_config, llm.vllm_config.parallel_config
        itemsize = torch.empty((), dtype=mc.dtype).element_size()
        return 2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * itemsize
    except Exception:  # noqa: BLE001 - a vLLM API change must not stop the engine; bytes are optional
        log.warning("cannot size the KV cache per token; KV transfer bytes will not be reported", exc_info=True)
        return None


# ---- KV cache events ---------------------------------------------------------------------------


def kv_events_config(endpoint: str, hwm: int) -> Any:
    """The vLLM KVEventsConfig that makes the engine publish its prefix cache's events on `endpoint`."""
    return KV_EVENTS_CONFIG.resolve()(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=endpoint,
        # No replay: after a gap the reader starts over (CacheDelta.cleared) instead of asking
        # for missed batches, so the publisher need not keep past batches in memory either.
        replay_endpoint=None,
        buffer_steps=0,
        hwm=hwm,
        # Left at vLLM's default (100,000): the scheduler blocks on a full queue, so it must be large.
        topic="",  # one publisher per endpoint: nothing to tell apart
    )


def kv_event_batch_type() -> type:
    """vLLM's KVEventBatch: what one published message decodes to (msgspec)."""
    return KV_EVENT_BATCH.resolve()


def kv_event_types() -> tuple[type, type, type]:
    """vLLM's KV cache event classes: (AllBlocksCleared, BlockStored, BlockRemoved)."""
    return ALL_BLOCKS_CLEARED.resolve(), BLOCK_STORED.resolve(), BLOCK_REMOVED.resolve()
