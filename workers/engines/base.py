"""The interface every engine backend implements.

A worker drives exactly one engine. Two backends exist:
  - `vllm`: a real in-process vLLM AsyncLLM with the NIXL KV connector;
  - `sim`:  a timing model with no weights (fast tests, fleet load tests).
The choice is always explicit in config/CLI; there is no silent fallback.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from skyline.core.adapters import config_problem
from skyline.core.messages import AdapterRef, SamplingSpec


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    priority: int = 0  # vLLM semantics: lower value = scheduled first
    cache_salt: str | None = None  # vLLM's prefix-cache salt (TokensPrompt.cache_salt)
    # The request has latency targets (False: it asked for no SLO; the engine may take longer steps
    # while only such requests are in it: scheduler/step_budget.py's relaxed steps).
    targeted: bool = True
    adapter: AdapterRef | None = None  # the LoRA adapter it runs with (None: the base model)
    # The W3C trace context of the worker's span of it: vLLM's own span of the request joins the trace
    # (an engine started with --otlp-traces-endpoint; skyline/core/tracing.py).
    trace_headers: dict[str, str] | None = None


@dataclass
class PrefillResult:
    """What a prefill leaves behind: the handle a decode engine uses to pull KV."""

    kv_handle: dict[str, Any]
    prompt_tokens: int
    prompt_logprobs: list | None = None  # skyline.core.logprobs wire form, when the request asked for them
    cached_tokens: int | None = None  # leading prompt tokens the engine's prefix cache held (None: unknown)


@dataclass
class GenerationChunk:
    """New output of one choice since its previous chunk. A choice's last chunk has its
    `finish_reason`; the request's last chunk has `done` (with n = 1, the same chunk).
    Logprobs are in skyline.core.logprobs' wire form."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    choice: int = 0
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None  # with the request's first chunk, when asked for
    done: bool = False
    # Set on the last chunk: evidence of where the prompt's KV came from, e.g.
    # {"remote_prefill": True, "num_cached_tokens": 12}. Shown to clients in
    # the final frame and used by tests to prove a NIXL transfer happened.
    kv_transfer: dict[str, Any] = field(default_factory=dict)


class KVPullFailed(Exception):
    """The engine could not load the prompt's KV from the prefill engine (NIXL handshake or transfer
    failed, or timed out) and generated nothing: the decode worker computes the prompt itself."""


class RequestRefused(Exception):
    """The engine cannot serve this request as asked (a client error: the worker answers it with
    `status`, never retries it)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV cache in use, 0..1


@dataclass
class CacheDelta:
    """What changed in an engine's prefix cache since the last `Engine.cache_delta` call, as block
    hashes of Skyline's chain (scheduler/prefix.py): the worker mirrors it into the fleet's cache
    view (skyline/core/cache_view.py). `cleared`: everything held before `stored` is gone."""

    stored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


# What one engine step computed and how long it took: (prompt tokens, decode tokens, seconds).
StepObserver = Callable[[int, int, float], None]


class Engine(abc.ABC):
    """One model replica. All methods are called from the worker's event loop."""

    kind: str = "abstract"
    # Called after each engine step by engines that can time their steps (vLLM); the worker's
    # metrics set it. The step time the simulator's profile predicts, measured in the fleet.
    on_step: StepObserver | None = None
    # The prefix cache's block size in tokens, known after `start`; 0 = the engine reports no cache
    # events (`cache_delta` stays None) and the gateway places none of this worker's requests by prefix.
    cache_block_size: int = 0
    # The context length it serves (prompt and output tokens), known after `start`: advertised in the
    # heartbeat, so a gateway renders and checks this model's requests with it (gateway/models.py).
    max_model_len: int = 0

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights / allocate KV cache. May take tens of seconds."""

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    @abc.abstractmethod
    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Compute the prompt's KV and keep it for a remote decode engine to pull."""

    @abc.abstractmethod
    def generate(
        self, req: EngineRequest, kv_handle: dict[str, Any] | None
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the output. With `kv_handle`, pull the prompt's KV from the
        prefill engine it names; without, prefill locally (colocated)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks. Unknown ids are ignored."""

    async def release_kv(self, request_id: str, kv_handle: dict[str, Any]) -> None:
        """Free the prefill engine's blocks behind `kv_handle` (a prompt handed off to this engine's
        pool) without pulling them: the request ended before this engine took the handle (its client
        left). Without it the prefill engine holds them for its whole lease. Engines with no remote
        KV have nothing to free."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    def progress(self) -> tuple[int, int] | None:
        """(requests the engine holds, steps it has completed so far), for the worker's stall watch
        (scheduler/stall.py); None: this engine cannot tell, and no stall is ever declared."""
        return None

    def computed_tokens(self, request_id: str) -> int | None:
        """Prompt tokens of `request_id` computed so far (prefix-cache hits included), for the claim defer's
        tokens left (scheduler/claiming.py `tokens_left`); None: this engine does not tell (or does not hold
        it), and the worker estimates from the claim's time at its measured rate."""
        return None

    def failure(self) -> str | None:
        """Why the engine can compute nothing more (its core process died), or None while it can."""
        return None

    def kill(self) -> None:
        """End the engine's processes at once: it is stuck, and a clean shutdown would hang with it."""

    def cache_delta(self) -> CacheDelta | None:
        """Blocks stored in and evicted from the prefix cache since the previous call (None: nothing
        new, or no cache events). Called from the worker's event loop, often: must not block."""
        return None

    # -- LoRA adapters (skyline/core/adapters.py, workers/adapters.py) --------------------------
    # Adapters the engine runs at once (vLLM's max_loras), known after `start`; 0 = no LoRA: a request
    # with an adapter is refused. An engine loads a request's adapter if it does not hold it yet: when
    # the request arrives while it has room for one more, else when it runs it (vLLM: the step that
    # runs it, evicting an adapter that step does not use); `adapter_load_ms` is what its loads took
    # (mean, 0 = none measured), `adapter_loads` how many it made (the worker's
    # skyline_worker_adapter_loads_total).
    lora_slots: int = 0
    adapter_load_ms: float = 0.0
    adapter_loads: int = 0
    # `vllm serve`'s --lora-modules given to this engine's worker (vLLM's LoRAModulePath each): the worker
    # registers them in the fleet's registry at start.
    static_adapters: tuple = ()

    async def adapters(self) -> dict[int, str]:
        """The adapters the engine holds (loaded, not evicted): lora id -> name."""
        return {}

    async def check_adapter(self, path: str) -> tuple[str, bool]:
        """Could this engine load a LoRA adapter from `path`, read where it runs? ("", False) = yes; else
        (why not, whether nothing is there). Here: its adapter_config.json reads as a config."""
        return config_problem(path)

    async def remove_adapter(self, lora_id: int) -> None:
        """Drop the adapter loaded under `lora_id` (unloaded from the fleet). Unknown ids are ignored."""
