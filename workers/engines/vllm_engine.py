"""`vllm`: a real in-process vLLM engine (AsyncLLM) with the NIXL KV connector.

One VllmEngine per process. vLLM reads its settings from environment
variables in the engine-core process, which AsyncLLM spawns when it is built;
so `start()` sets them in this process's environment first and two engines in
one process would share (and fight over) them.

Disaggregation uses vLLM's NixlConnector in `kv_both` role, so every engine can
be a prefill or a decode engine:
  prefill: max_tokens=1 with kv_transfer_params {"do_remote_decode": True};
           the finished output's kv_transfer_params is the handle (engine id,
           block ids, side-channel host/port, ...);
  decode:  the same prompt with kv_transfer_params = that handle; the decode
           engine pulls the blocks over NIXL instead of computing them.

Evidence that the KV came over NIXL (checked in vLLM 0.32 sources):
  * `PrefillStats.num_external_cached_tokens` on the engine-core output is the
    number of prompt tokens loaded through the KV connector for that request.
    It is not copied into RequestOutput, so we tap OutputProcessor.process_outputs
    to read it (`num_remote_tokens`; vllm_internals.py). It is > 0 only when blocks were pulled.
  * `RequestOutput.num_cached_tokens` = local prefix-cache hits + connector
    tokens. Caveat: when the handle carries `remote_prefill_cached_tokens`
    (the prefill engine's own prefix-cache hits, added by vLLM's scheduler),
    vLLM reports THAT number instead (0 for a fresh prompt); we move that key
    out of the handle so `num_cached_tokens` is the decode engine's own count.

What the prefix cache holds (`cache_delta`) comes from vLLM's own KV cache
events, read and translated into Skyline's block chain by vllm_kv_events.py.

The vLLM internals this engine uses (the output processor, the stat logger, KV rejections, an
idle engine's step) are in vllm_internals.py; here only vLLM's public API is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from skyline.core import logprobs
from skyline.core.messages import SamplingSpec
from skyline.workers.engines import vllm_internals, vllm_kv_events
from skyline.workers.engines.base import (
    CacheDelta, Engine, EngineRequest, EngineStats, GenerationChunk, KVPullFailed, PrefillResult, RequestRefused,
)

log = logging.getLogger("skyline.engine.vllm")
steps_log = logging.getLogger("skyline.engine.steps")  # one DEBUG line per vLLM step

# How long (s) a prefill engine keeps a prompt's KV blocks for a decode engine
# that has not pulled them yet. vLLM 0.32 replaced VLLM_NIXL_ABORT_REQUEST_TIMEOUT
# with a lease: kv_connector_extra_config["kv_lease_duration"] (default 30 s);
# a decode engine that has admitted the request sends heartbeats that extend it,
# but work waiting in a Skyline decode queue sends none. On expiry the prefill
# engine frees the blocks ("Releasing expired KV blocks ..."). Seen here: a pull
# after expiry still "succeeds" and reads whatever the freed blocks now hold
# (correct only while nothing reused them), so callers should not hand a decode
# engine a handle older than the lease; redo the prefill instead.
DEFAULT_KV_LEASE_S = 60


class KVTransferError(RuntimeError):
    """The engine finished a request with an error (e.g. its KV could not be pulled)."""


class VllmEngine(Engine):
    kind = "vllm"

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        max_model_len: int | None = 2048,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.9,
        cpu_bind: str | None = None,
        nixl_port: int | None = None,
        nixl_host: str | None = None,
        kv_transfer: bool = True,
        scheduling_policy: str = "priority",
        enable_chunked_prefill: bool | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        long_prefill_token_threshold: int = 0,
        background_step_tokens: int = 0,
        hold_background_steps: int = 0,
        relaxed_step_tokens: int = 0,
        urgent_priority: int = 0,
        kv_lease_s: int = DEFAULT_KV_LEASE_S,
        kv_role: str = "kv_both",
        enforce_eager: bool | None = None,
        engine_nice: int = 0,
        cache_events: bool = True,
        engine_args: dict[str, Any] | None = None,
        otlp_traces_endpoint: str = "",
    ):
        self.model = model
        # The worker's --otlp-traces-endpoint: vLLM's own span of each request joins the worker's trace.
        self.otlp_traces_endpoint = otlp_traces_endpoint
        # The user's vLLM engine arguments ({dest: value}, parsed by vLLM's parser: skyline/core/engine_args.py):
        # every one reaches the engine; where one is also a default here (eager, KV cache size, chunked
        # prefill), the user's wins; what Skyline controls was refused at start (engine_args.refusals).
        self.engine_args = dict(engine_args or {})
        self.static_adapters = tuple(self.engine_args.pop("lora_modules", None) or ())  # the worker's to register
        self.engine_nice = engine_nice
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib  # 0 = vLLM sizes the cache (gpu_memory_utilization on GPUs)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.cpu_bind = cpu_bind
        self.nixl_port = nixl_port
        self.nixl_host = nixl_host
        self.kv_transfer = kv_transfer
        self.scheduling_policy = scheduling_policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size  # None: vLLM's default for the platform
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # Steps shaped by tier (vllm_scheduler.py): short while only looser-tier prompts compute, and
        # those held back while strictest-tier prompts compute. Both 0 = vLLM's own scheduler.
        self.background_step_tokens = background_step_tokens
        self.hold_background_steps = hold_background_steps
        # Steps while only requests that asked for no SLO are in the engine (scheduler/step_budget.py):
        # the engine is built for them, and the step-shaping scheduler keeps other steps to the step above.
        self.relaxed_step_tokens = relaxed_step_tokens
        self.urgent_priority = urgent_priority
        self.kv_lease_s = kv_lease_s
        # vLLM 0.32 logs kv_both as deprecated (kv_producer / kv_consumer per
        # role); kv_both lets one engine serve disagg decode AND colocated work.
        self.kv_role = kv_role
        # None = eager on CPU: measured here, torch.compile made start-up 69 s
        # instead of 16 s (one engine, one core) for the same decode throughput
        # (~82 vs ~80 tok/s, 8 x 64 tokens); on GPU compile + CUDA graphs pay off.
        self.enforce_eager = enforce_eager
        # Publish the prefix cache's events (vllm_kv_events.py) so the gateway can place requests
        # by prefix: one ZMQ message per step that changed the cache, from the engine core's own thread.
        # An engine without a prefix cache (--no-enable-prefix-caching) has no cache events: this worker
        # reports no cache, and the gateway places none of its requests by prefix.
        self.cache_events = cache_events and self.engine_args.get("enable_prefix_caching") is not False
        self._kv_events: vllm_kv_events.KvEventReader | None = None
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._in_flight: set[str] = set()
        self._sched: vllm_internals.StepReport | None = None  # the latest step's (from our stat logger)
        # Engine steps whose stats reached this process: vLLM reports every step that has requests
        # (one waiting for remote KV included), so while requests are in, this count moves.
        self._steps = 0
        self._remote_tokens: dict[str, int] = {}  # external request id -> tokens loaded via connector
        self._pulled_from: set[str] = set()  # prefill engines this one has read KV from (NIXL handshake done)
        self._nudges: set[asyncio.Task] = set()  # see release_kv
        self.start_seconds = 0.0
        # LoRA adapters the engine was given, by fleet-wide id (vLLM's lora_int_id) -> name; which of
        # them it still holds is vLLM's to say (`adapters`: its LRU cache evicts).
        self._adapter_names: dict[int, str] = {}
        self._lora_cache_slots = 0  # adapters vLLM's cache holds (--max-cpu-loras, max_loras by default)
        self._left_to_vllm: set[int] = set()  # adapters counted as loads that vLLM makes at its next step
        self._lora_lock = asyncio.Lock()
        self._adapter_loads: list[float] = []  # ms each load took, the latest few
        # KV cache bytes of one token (K and V, every layer): sizes KV transfers in the timeline.
        self.kv_bytes_per_token: int | None = None

    # ---- lifecycle -------------------------------------------------------

    def _set_env(self) -> None:
        """Env read by the engine-core process; must be set before it is spawned."""
        if self.cpu_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_bind)
        if self.nixl_port is not None:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_port)
        if self.nixl_host:
            # Advertised in handles as remote_host: decode engines on other hosts connect to it.
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.nixl_host
        # A KV cache size given in VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes below.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        import torch

        from skyline.core.lifetime import mark_engine_processes
        from skyline.workers.engines import engine_processes

        mark_engine_processes()  # engine-core and executor processes end with this worker (engine_processes.py)
        if not torch.cuda.is_available():
            # CPU engines (engine_processes.py, loaded by vLLM in the engine processes): vLLM's engine-core
            # and executor processes would spin on their shared-memory queues through every step, on
            # cores the engines compute on.
            os.environ.setdefault(engine_processes.PAUSE_ENV, engine_processes.POLL_PAUSE_US)
            if self.kv_transfer:
                # CPU KV buffers: NIXL's progress thread would busy-poll the engine's own core...
                os.environ.setdefault(engine_processes.ENV, "200")
                # ... and the connector would move the engine's computing thread to the host's last core.
                os.environ.setdefault(engine_processes.KEEP_CORES_ENV, "1")

    def _engine_args(self) -> Any:
        import torch
        from vllm.config import KVTransferConfig

        from skyline.core import engine_args

        kv_cfg = None
        if self.kv_transfer:
            kv_cfg = KVTransferConfig(
                kv_connector="NixlConnector",
                kv_role=self.kv_role,
                # Staging buffer for NIXL; on CPU vLLM registers the KV cache itself.
                kv_buffer_device="cuda" if torch.cuda.is_available() else "cpu",
                kv_connector_extra_config={"kv_lease_duration": int(self.kv_lease_s)},
            )
        kwargs: dict[str, Any] = dict(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            scheduling_policy=self.scheduling_policy,
            kv_transfer_config=kv_cfg,
            disable_log_stats=False,  # scheduler stats feed stats()
            enable_logging_iteration_details=True,  # each step's tokens and time feed on_step
        )
        given = self.engine_args
        if self.otlp_traces_endpoint:
            kwargs["otlp_traces_endpoint"] = self.otlp_traces_endpoint
        if "enforce_eager" not in given:
            kwargs["enforce_eager"] = (not torch.cuda.is_available()) if self.enforce_eager is None else self.enforce_eager
        if self._kv_events is not None:
            kwargs["kv_events_config"] = vllm_kv_events.kv_events_config(self._kv_events.endpoint)
        if self.kv_cache_gib > 0 and given.get("kv_cache_memory_bytes") is None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_gib * (1 << 30))
        if self.enable_chunked_prefill is not None and "enable_chunked_prefill" not in given:
            kwargs["enable_chunked_prefill"] = self.enable_chunked_prefill
        step = self.max_num_batched_tokens
        if step is not None:
            kwargs["max_num_batched_tokens"] = max(step, self.relaxed_step_tokens)
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.long_prefill_token_threshold > 0:
            kwargs["long_prefill_token_threshold"] = self.long_prefill_token_threshold
        relaxed = self.relaxed_step_tokens if step is not None and self.relaxed_step_tokens > step else 0
        if (self.background_step_tokens > 0 or self.hold_background_steps > 0 or relaxed) \
                and self.scheduling_policy == "priority":
            from skyline.workers.engines import vllm_scheduler

            kwargs["scheduler_cls"] = vllm_scheduler.QUALNAME
            kwargs["additional_config"] = {vllm_scheduler.CONFIG_KEY: {
                "background_tokens": self.background_step_tokens, "max_held_steps": self.hold_background_steps,
                "urgent_priority": self.urgent_priority, "step_tokens": step or 0, "relaxed_tokens": relaxed}}
        return engine_args.engine_args(given, kwargs)

    async def start(self) -> None:
        # Blocks the event loop for the whole start-up (~40 s on CPU): AsyncLLM
        # must be built on the loop thread (it starts its output task there).
        from vllm.v1.engine.async_llm import AsyncLLM

        self._set_env()
        vllm_internals.quiet_iteration_lines()
        t0 = time.monotonic()
        if self.cache_events:
            # Subscribed before the engine core exists, so that no step's events go by unseen.
            self._kv_events = vllm_kv_events.KvEventReader(vllm_kv_events.ipc_endpoint())
        try:
            with self._engine_priority():
                self._llm = AsyncLLM.from_engine_args(self._engine_args(), stat_loggers=[
                    vllm_internals.stat_logger_factory(self._on_step_report)])
        except BaseException:
            self._close_kv_events()
            raise
        try:
            self._watch_prefix_cache()
            vllm_internals.tap_connector_tokens(self._llm, self._remote_tokens)  # raises if vLLM's moved
        except BaseException:
            await self.shutdown()
            raise
        self.kv_bytes_per_token = vllm_internals.kv_bytes_per_token(self._llm)
        lora_config = self._llm.vllm_config.lora_config  # None unless --enable-lora
        self.lora_slots = int(lora_config.max_loras) if lora_config is not None else 0
        if lora_config is not None:
            self._lora_cache_slots = int(lora_config.max_cpu_loras or lora_config.max_loras)
        self.max_model_len = self._llm.model_config.max_model_len  # what vLLM settled on (EngineClient's config)
        self.start_seconds = time.monotonic() - t0
        log.info("vLLM engine up in %.1f s (model %s, bind %s, nixl port %s, prefix-cache blocks of %d tokens reported)",
                 self.start_seconds, self.model, self.cpu_bind, self.nixl_port, self.cache_block_size)

    def _watch_prefix_cache(self) -> None:
        """Report the prefix cache in blocks of the engine's size, if the engine caches prefixes at all
        (vLLM may turn it off, e.g. for MLA models on CPU): without it there are no events."""
        block_size = vllm_internals.prefix_cache_block_size(self._llm)
        if self._kv_events is None or not block_size:
            self._close_kv_events()
            return
        self._kv_events.state.block_size = self.cache_block_size = block_size

    def _close_kv_events(self) -> None:
        self.cache_block_size = 0
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None

    @contextlib.contextmanager
    def _engine_priority(self):
        """Spawn the engine's processes at a lower CPU priority than the control plane.

        With the NIXL connector, a vLLM CPU worker keeps threads busy-polling
        (NIXL's UCX progress loop: ~100% of a core even when idle, measured
        here). On a small host that starves Redis, the gateway and the workers'
        event loops for seconds at a time. Niceness is per thread on Linux and
        inherited by every thread and process created afterwards, so this
        thread is niced while AsyncLLM spawns the engine, then restored: the
        engines still get every cycle nobody else wants, while Redis and the
        control plane run as soon as they are ready.
        """
        if not self.engine_nice:
            yield
            return
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(19, before + self.engine_nice))
        try:
            yield
        finally:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, before)
            except PermissionError:
                log.warning("cannot restore this worker's CPU priority (no CAP_SYS_NICE); it stays at nice +%d",
                            self.engine_nice)

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._close_kv_events()

    def cache_delta(self) -> CacheDelta | None:
        return self._kv_events.poll() if self._kv_events is not None else None

    # ---- requests --------------------------------------------------------

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # The one sampled token is thrown away (the decode engine samples the
        # first token itself), so prefill samples greedily and skips detokenizing.
        # Prompt logprobs are computed here, where the prompt is: the decode engine never sees its logits.
        asked = (req.sampling.params or {}).get("prompt_logprobs")
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=asked is not None, output_kind=RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=asked,
            extra_args={"kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None,
            }},
        )
        final = None
        async for out in self._run(req, params):
            final = out
        if final is None or not final.outputs or final.outputs[0].finish_reason == "abort":
            raise asyncio.CancelledError(f"request {req.request_id} aborted")
        if final.outputs[0].finish_reason == "error":
            raise KVTransferError(f"prefill of {req.request_id} failed in the engine")
        if not final.kv_transfer_params:
            raise KVTransferError(f"prefill of {req.request_id} returned no KV handle (is kv_transfer on?)")
        return PrefillResult(kv_handle=_plain(final.kv_transfer_params), prompt_tokens=len(req.prompt_token_ids),
                             prompt_logprobs=logprobs.to_wire(final.prompt_logprobs) if asked is not None else None,
                             cached_tokens=final.num_cached_tokens)

    async def generate(self, req: EngineRequest, kv_handle: dict[str, Any] | None) -> AsyncIterator[GenerationChunk]:
        params = sampling_params(req.sampling)
        evidence: dict[str, Any] = {"remote_prefill": kv_handle is not None}
        if kv_handle is not None:
            handle = dict(kv_handle)
            # See the module docstring: this key would replace num_cached_tokens.
            evidence["prefill_cached_tokens"] = handle.pop("remote_prefill_cached_tokens", None)
            evidence["source_engine"] = handle.get("remote_engine_id")
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": handle}
            if params.prompt_logprobs is not None:  # the prefill engine computed them (this one never sees the prompt)
                params.prompt_logprobs = None
                params.skip_reading_prefix_cache = False
            if params.n > 1:
                # vLLM's n children would each pull the same remote blocks, and the prefill engine frees
                # them at the first reader's notification. Pull once, then fan out here: the children
                # find the prompt's blocks in this engine's prefix cache.
                evidence["num_remote_tokens"] = await self._pull_once(req, handle)
                evidence["pulled_once_for_n"] = params.n
                params.extra_args = {k: v for k, v in params.extra_args.items() if k != "kv_transfer_params"} or None
        first = True
        async for out in self._run(req, params):
            prompt_lps = logprobs.to_wire(out.prompt_logprobs) if first and out.prompt_logprobs else None
            first_output, first = first, False
            if first_output and kv_handle is not None:
                self._pulled_from.add(evidence["source_engine"])
            last = len(out.outputs) - 1
            for i, comp in enumerate(out.outputs):
                if comp.finish_reason == "error":
                    if kv_handle is not None and not comp.token_ids and first_output:
                        # vLLM (kv_load_failure_policy "fail") ends a request whose KV it could not load
                        # before computing anything: nothing reached the client, the prompt can be computed.
                        raise KVPullFailed(f"request {req.request_id}: loading its KV from "
                                           f"{evidence.get('source_engine')} failed in the engine")
                    raise KVTransferError(f"request {req.request_id} failed in the engine (KV pull or model error)")
                chunk = GenerationChunk(
                    token_ids=list(comp.token_ids), text=comp.text, choice=comp.index, finish_reason=comp.finish_reason,
                    logprobs=logprobs.to_wire(comp.logprobs) if comp.logprobs else None,
                    cumulative_logprob=comp.cumulative_logprob, stop_reason=comp.stop_reason,
                    prompt_logprobs=prompt_lps if i == 0 else None)
                if out.finished and i == last:
                    chunk.done = True
                    chunk.finish_reason = chunk.finish_reason or "stop"
                    evidence["num_cached_tokens"] = out.num_cached_tokens or 0
                    evidence.setdefault("num_remote_tokens", self._remote_tokens.get(req.request_id, 0))
                    chunk.kv_transfer = evidence
                if chunk.token_ids or chunk.text or chunk.finish_reason or chunk.prompt_logprobs or chunk.done:
                    yield chunk

    async def _pull_once(self, req: EngineRequest, handle: dict[str, Any]) -> int:
        """Load the prompt's KV from the prefill engine with one one-token sequence; the tokens loaded."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # The same salt: the n sequences that follow must find these blocks in the prefix cache.
        pull = EngineRequest(f"{req.request_id}-kvpull", req.prompt_token_ids, req.sampling, req.priority,
                             req.cache_salt, req.targeted, req.adapter, req.trace_headers)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"kv_transfer_params": handle})
        loaded = 0
        async for out in self._run(pull, params):
            loaded = self._remote_tokens.get(pull.request_id, loaded)
            if out.finished and out.outputs and out.outputs[0].finish_reason == "error":
                raise KVPullFailed(f"request {req.request_id}: pulling its KV failed in the engine")
        return loaded

    async def _run(self, req: EngineRequest, params: Any) -> AsyncIterator[Any]:
        """Submit one request under the caller's id and yield vLLM's outputs."""
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            raise RuntimeError("engine not started")
        self._in_flight.add(req.request_id)
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        if not req.targeted:  # the step-shaping scheduler may step long while only such requests are in
            params.extra_args = {**(params.extra_args or {}), vllm_internals.BEST_EFFORT_ARG: True}
        lora = await self._lora_request(req) if req.adapter is not None else None
        try:
            # vLLM appends a random suffix to make its internal request id; the
            # id given here stays the external id, which abort() accepts.
            async for out in self._llm.generate(
                prompt, params, req.request_id, lora_request=lora, trace_headers=req.trace_headers,
                # vLLM rejects a non-zero priority under the fcfs policy.
                priority=req.priority if self.scheduling_policy == "priority" else 0,
            ):
                yield out
        finally:
            self._in_flight.discard(req.request_id)
            self._remote_tokens.pop(req.request_id, None)

    async def _lora_request(self, req: EngineRequest) -> Any:
        """vLLM's LoRARequest for the request's adapter. An adapter vLLM's cache lacks is loaded here, timed
        (the load time workers advertise, which admission control counts), while the cache has room; with
        the cache full it is left to vLLM, which loads it at the step that runs the request and evicts an
        adapter that step does not use, as `vllm serve` does. Loading it here would evict the least recently
        used adapter at once, though requests still running may use it, and vLLM would read that one again
        at its next step: on the multi-LoRA benchmark (2 slots, 8 adapters) that doubled the adapter loads."""
        from vllm.lora.request import LoRARequest

        ref = req.adapter
        assert ref is not None
        if not self.lora_slots:
            raise RequestRefused(f"the model `{ref.name}` is a LoRA adapter and this engine runs without LoRA "
                                 "(start its workers with --enable-lora)", status=400, param="model")
        lora = LoRARequest(lora_name=ref.name, lora_int_id=ref.lora_id, lora_path=ref.path)
        first = ref.lora_id not in self._adapter_names
        async with self._lora_lock:  # two loads at once would both see the same free room
            held = await self._llm.list_loras()
            if ref.lora_id in held:
                self._left_to_vllm.discard(ref.lora_id)
            elif len(held) >= self._lora_cache_slots:
                # vLLM's step fails the engine on an adapter it cannot read: one this engine never ran is
                # read as its load reads it first (config and checks) and refused here if that fails.
                if first and (problem := (await self.check_adapter(ref.path))[0]):
                    raise RequestRefused(f"the LoRA adapter `{ref.name}` could not be loaded from {ref.path}: "
                                         f"{problem}", status=400, param="model")
                if ref.lora_id not in self._left_to_vllm:  # one load however many of its requests wait for it
                    self._left_to_vllm.add(ref.lora_id)
                    self.adapter_loads += 1
            else:
                await self._load_adapter(lora, ref)
            self._adapter_names[ref.lora_id] = ref.name
        return lora

    async def _load_adapter(self, lora: Any, ref: Any) -> None:
        """vLLM's own load of the adapter (what its load_lora_adapter route calls), timed and counted."""
        t0 = time.monotonic()
        try:
            await self._llm.add_lora(lora)
        except Exception as exc:
            raise RequestRefused(f"the LoRA adapter `{ref.name}` could not be loaded from {ref.path}: {exc}",
                                 status=400, param="model") from None
        self.adapter_loads += 1
        self._adapter_loads = [*self._adapter_loads[-7:], (time.monotonic() - t0) * 1000]
        self.adapter_load_ms = sum(self._adapter_loads) / len(self._adapter_loads)
        log.info("LoRA adapter %s (id %d) loaded from %s in %.0f ms", ref.name, ref.lora_id, ref.path,
                 self._adapter_loads[-1])

    async def check_adapter(self, path: str) -> tuple[str, bool]:
        """vLLM's own reading of an adapter before its weights (what its load does first): the path as it
        resolves it, PEFTHelper's config and its checks against this engine's LoRA config (a rank over
        --max-lora-rank, a bias...)."""
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import get_adapter_absolute_path

        assert self._llm is not None
        config = self._llm.vllm_config
        positions = getattr(config.model_config.hf_config.get_text_config(), "max_position_embeddings", None)

        def read() -> tuple[str, bool]:
            try:
                PEFTHelper.from_local_dir(get_adapter_absolute_path(path), positions).validate_legal(config.lora_config)
            except FileNotFoundError:
                return f"no adapter at {path}", True
            except Exception as exc:  # noqa: BLE001 - vLLM's own reasons, passed on as its load route would
                return str(exc), False
            return "", False

        return await asyncio.to_thread(read)

    async def adapters(self) -> dict[int, str]:
        if self._llm is None or not self.lora_slots:
            return {}
        held = await self._llm.list_loras()
        self._left_to_vllm -= set(held)  # vLLM loaded them for the requests that named them
        return {i: self._adapter_names[i] for i in sorted(held) if i in self._adapter_names}

    async def remove_adapter(self, lora_id: int) -> None:
        self._left_to_vllm.discard(lora_id)
        if self._llm is not None and self._adapter_names.pop(lora_id, None) is not None:
            await self._llm.remove_lora(lora_id)
            log.info("LoRA adapter id %d removed (unloaded from the fleet)", lora_id)

    async def abort(self, request_id: str) -> None:
        # abort() with the external id aborts every internal request behind it;
        # unknown ids are ignored by vLLM. The generator gets a final "abort" output.
        if self._llm is not None and request_id in self._in_flight:
            await self._llm.abort(request_id)

    async def release_kv(self, request_id: str, kv_handle: dict[str, Any]) -> None:
        # vLLM's own path for a hand-off its decode side refuses: a request submitted already
        # aborted, whose connector tells the prefill engine (over NIXL, notification only) that its
        # blocks will not be read. The id is this engine's; the prefill engine's is in the handle.
        if self._llm is None:
            return
        handle = {k: v for k, v in kv_handle.items() if k != "remote_prefill_cached_tokens"}
        await vllm_internals.reject_kv_transfer(self._llm, f"{request_id}-release", handle)
        if handle.get("remote_engine_id") not in self._pulled_from:
            # From a prefill engine this one has not read from, vLLM handshakes in the background and
            # sends the notification at a later step, which an idle engine never takes (seen: the
            # blocks stayed for the whole lease). Two one-token steps give it one, once the
            # handshake had time; an engine with requests in flight steps anyway.
            task = asyncio.ensure_future(self._step_soon(request_id))
            self._nudges.add(task)
            task.add_done_callback(self._nudges.discard)

    async def _step_soon(self, request_id: str) -> None:
        for i, delay_s in enumerate((0.5, 2.0)):
            await asyncio.sleep(delay_s)
            if self._llm is None:
                return
            if not self._in_flight:
                await vllm_internals.take_one_step(self._llm, f"{request_id}-step-{i}")

    def stats(self) -> EngineStats:
        s = self._sched
        if s is None or not self._in_flight:
            # vLLM only reports stats after engine steps; with nothing in
            # flight the last report may be stale, so trust our own count.
            return EngineStats(running=0, waiting=0, kv_usage=s.kv_usage if s is not None else 0.0)
        running = min(s.running, len(self._in_flight))
        waiting = min(s.waiting, len(self._in_flight) - running)
        return EngineStats(running=running, waiting=waiting, kv_usage=s.kv_usage)

    def progress(self) -> tuple[int, int] | None:
        return len(self._in_flight), self._steps

    def failure(self) -> str | None:
        if self._llm is not None and self._llm.errored:
            return "vLLM's engine core is dead (its process exited or its output handler failed)"
        return None

    def kill(self) -> None:
        # The worker's children are this engine's processes (engine core; on CPU, its executor).
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()

    # ---- vLLM hooks ------------------------------------------------------

    def _on_step_report(self, report: vllm_internals.StepReport) -> None:
        """Each engine step's scheduler stats (running, waiting, KV usage) for stats(), and the step for on_step."""
        self._sched = report
        self._steps += 1
        if not report.has_step:
            return
        if self.on_step is not None:
            self.on_step(report.prompt_tokens, report.decode_tokens, report.elapsed_ms / 1000)
        if steps_log.isEnabledFor(logging.DEBUG):  # `--log-level debug`: each step, to line up with events
            steps_log.debug("engine step: %d prompt + %d decode tokens in %.1f ms (running %d, waiting %d)",
                            report.prompt_tokens, report.decode_tokens, report.elapsed_ms, report.running,
                            report.waiting)


def sampling_params(spec: SamplingSpec) -> Any:
    """The request's vLLM SamplingParams (built by vLLM's request models in the gateway), streaming
    deltas, with the worker's `max_tokens` (lower after a migration); Skyline's own fields only for
    requests made without the gateway (the simulator's profiler, tests)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if spec.params is not None:
        import msgspec

        params = msgspec.convert(spec.params, SamplingParams)
        params.max_tokens = spec.max_tokens
        params.output_kind = RequestOutputKind.DELTA  # frames carry deltas; the gateway assembles what was asked
        return params

    greedy = spec.temperature <= 0.0
    return SamplingParams(
        max_tokens=spec.max_tokens,
        temperature=0.0 if greedy else spec.temperature,  # 0 = greedy in vLLM
        top_p=1.0 if greedy else spec.top_p,
        top_k=spec.top_k if spec.top_k > 0 else 0,  # 0 = all tokens
        seed=spec.seed,
        stop=list(spec.stop) or None,
        stop_token_ids=list(spec.stop_token_ids) or None,
        ignore_eos=spec.ignore_eos,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        output_kind=RequestOutputKind.DELTA,  # each output carries only new tokens and text
    )


def _plain(value: Any) -> Any:
    """A copy made of dict/list/str/int/float/bool/None only (msgpack-safe)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)
