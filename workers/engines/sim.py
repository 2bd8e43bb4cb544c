"""`sim`: a continuous-batching engine with a timing model instead of weights.

A documented backend (like Dynamo's mocker), never a fallback for `vllm`. It
runs the same step loop shape as a real engine so that queueing, batching and
preemption effects show up in fleet tests:

  step = prefill step, if prompts are waiting: base + per_token * tokens in the step
       | decode step otherwise: base + per_seq * running sequences (one token each)

Output tokens are deterministic bytes (token id = byte, the tokenizer of
skyline/core/sim_model.py), a function of the prompt, so tests can compare runs.
Sampling parameters other than max_tokens and stop strings do not change the
text (it never ends with EOS); `n` choices each get the same text (timed as one sequence);
logprobs and structured outputs, which need a model, are refused with a 400. A "KV handle" names the
prefill engine and the prompt length; the decode side charges no transfer time.

The prefix cache is modelled as vLLM's is: full blocks of `SIM_BLOCK_SIZE` tokens, keyed by their
tokens and all before them (Skyline's chain, scheduler/prefix.py), at most `prefix_cache_blocks`
of them, least recently used evicted first. A prompt's leading cached blocks cost no prefill time
(vLLM recomputes at least the last prompt token, so does the sim); the blocks of prompt and output
are stored once computed (the output's when the sequence ends), and every store and eviction is
reported as a cache event.

LoRA adapters are modelled as vLLM runs them: at most `lora_slots` adapters (vLLM's max_loras) among
the sequences of a step, so a prompt whose adapter would be one too many waits in the queue until a
slot's sequences end; the engine keeps as many adapters loaded (least recently used evicted first)
and a step that first runs an adapter it does not hold costs `lora_load_s` more. Blocks computed with
an adapter are keyed with it (as vLLM's hash includes the adapter): never a hit for another adapter
or for the base model.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from skyline.core.config import EngineConfig
from skyline.scheduler.prefix import block_chain, matched_blocks
from skyline.workers.engines.base import (
    CacheDelta,
    Engine,
    EngineRequest,
    EngineStats,
    GenerationChunk,
    PrefillResult,
    RequestRefused,
)

_TEXT = (
    b"Skyline simulated output: the quick brown fox jumps over the lazy dog while the scheduler "
    b"keeps every engine busy and every deadline in sight. "
)


_DEFAULTS = EngineConfig()  # the defaults live in the config, once
# vLLM's own step size where the config leaves it to vLLM (max_num_batched_tokens = 0).
VLLM_DEFAULT_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SimTiming:
    prefill_base_s: float = _DEFAULTS.sim_prefill_base_s
    prefill_per_token_s: float = _DEFAULTS.sim_prefill_per_token_s
    decode_base_s: float = _DEFAULTS.sim_decode_base_s
    decode_per_seq_s: float = _DEFAULTS.sim_decode_per_seq_s
    # Prompt tokens per prefill step (chunked prefill): a long prompt takes
    # several steps, so an abort frees the engine within one chunk.
    max_batch_tokens: int = _DEFAULTS.max_num_batched_tokens
    prefix_cache_blocks: int = _DEFAULTS.sim_prefix_cache_blocks
    lora_slots: int = _DEFAULTS.sim_max_loras
    lora_load_s: float = _DEFAULTS.sim_lora_load_s

    @classmethod
    def of(cls, ec: EngineConfig) -> SimTiming:
        """The timing an engine config describes: its sim_* times, its step size, prefix cache and LoRA slots."""
        return cls(ec.sim_prefill_base_s, ec.sim_prefill_per_token_s, ec.sim_decode_base_s, ec.sim_decode_per_seq_s,
                   ec.max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS, ec.sim_prefix_cache_blocks,
                   ec.sim_max_loras, ec.sim_lora_load_s)


SIM_BLOCK_SIZE = 16  # vLLM's default block size on GPUs


class SimPrefixCache:
    """Which blocks the sim engine holds (LRU), and the events a worker mirrors into the cache view."""

    def __init__(self, capacity_blocks: int, block_size: int = SIM_BLOCK_SIZE):
        self.capacity, self.block_size = capacity_blocks, block_size
        self.blocks: OrderedDict[str, None] = OrderedDict()
        self.delta = CacheDelta()

    def chain(self, token_ids: list[int], salt: str | None) -> list[str]:
        return block_chain(token_ids, self.block_size, self.capacity, salt or "")

    def cached_tokens(self, token_ids: list[int], salt: str | None) -> int:
        """Leading prompt tokens already held (touched: they are in use again); never the whole prompt."""
        chain = self.chain(token_ids, salt)
        n = matched_blocks(chain, self.blocks)
        for h in chain[:n]:
            self.blocks.move_to_end(h)
        return min(n * self.block_size, max(0, len(token_ids) - 1))

    def store(self, token_ids: list[int], salt: str | None) -> None:
        for h in self.chain(token_ids, salt):
            if h not in self.blocks:
                self.delta.stored.append(h)
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.delta.removed.append(self.blocks.popitem(last=False)[0])

    def take_delta(self) -> CacheDelta | None:
        delta, self.delta = self.delta, CacheDelta()
        return delta or None


@dataclass
class _Seq:
    req: EngineRequest
    prefill_only: bool
    remote_kv: bool
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    produced: int = 0
    prefilled: int = 0  # prompt tokens computed so far (or found in the prefix cache)
    cached: int = 0  # leading prompt tokens the prefix cache held
    text: bytes = b""
    start: int = 0
    activated: bool = False  # its adapter holds one of the engine's slots (it has run a step)
    scheduled: bool = False  # a step has computed (some of) its prompt: vLLM counts it running from then on


_ABORTED = object()


class SimEngine(Engine):
    kind = "sim"

    def __init__(self, timing: SimTiming | None = None, engine_id: str | None = None, max_model_len: int = 2048):
        self.timing = timing or SimTiming()
        self.max_model_len = max_model_len  # reported as vLLM's engine reports its own
        self.engine_id = engine_id or f"sim-{uuid.uuid4().hex[:8]}"
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._steps = 0  # steps completed: the worker's stall watch reads them (progress)
        self.cache = SimPrefixCache(self.timing.prefix_cache_blocks) if self.timing.prefix_cache_blocks else None
        self.cache_block_size = self.cache.block_size if self.cache else 0
        self.lora_slots = self.timing.lora_slots
        self._loras: OrderedDict[int, str] = OrderedDict()  # adapters held: lora id -> name, LRU first
        self._load_due_s = 0.0  # adapter loads the next step pays for

    def cache_delta(self) -> CacheDelta | None:
        return self.cache.take_delta() if self.cache else None

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop(), name="sim-engine")

    async def shutdown(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    async def adapters(self) -> dict[int, str]:
        return dict(self._loras)

    async def remove_adapter(self, lora_id: int) -> None:
        self._loras.pop(lora_id, None)

    def _active_adapters(self) -> set[int]:
        """The adapters of the sequences that hold slots: running, or partly computed."""
        return {s.req.adapter.lora_id for s in self._by_id.values() if s.activated and s.req.adapter is not None}

    def _activate(self, seq: _Seq, active: set[int]) -> bool:
        """Run `seq`'s adapter in this step if a slot allows (loading it if not held); False: it waits."""
        ref = seq.req.adapter
        if ref is None or seq.activated:
            return True
        if ref.lora_id not in active and len(active) >= self.lora_slots:
            return False
        seq.activated = True
        active.add(ref.lora_id)
        if ref.lora_id in self._loras:
            self._loras.move_to_end(ref.lora_id)
            return True
        self._load_due_s += self.timing.lora_load_s
        self.adapter_loads += 1
        self.adapter_load_ms = self.timing.lora_load_s * 1000
        self._loras[ref.lora_id] = ref.name
        for lora_id in list(self._loras):  # keep as many loaded as run at once, evicting idle ones first
            if len(self._loras) <= self.lora_slots:
                break
            if lora_id not in active:
                del self._loras[lora_id]
        return True

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        _refuse_adapter_without_lora(req, self.lora_slots)
        seq = self._admit(req, prefill_only=True, remote_kv=False)
        item = await seq.out.get()
        if item is _ABORTED:
            raise asyncio.CancelledError(f"request {req.request_id} aborted")
        handle = {"engine_id": self.engine_id, "request_id": req.request_id, "num_tokens": len(req.prompt_token_ids)}
        return PrefillResult(kv_handle=handle, prompt_tokens=len(req.prompt_token_ids), cached_tokens=seq.cached)

    async def generate(self, req: EngineRequest, kv_handle: dict[str, Any] | None) -> AsyncIterator[GenerationChunk]:
        _refuse_what_sim_cannot_compute(req)
        _refuse_adapter_without_lora(req, self.lora_slots)
        seq = self._admit(req, prefill_only=False, remote_kv=kv_handle is not None)
        n = max(1, req.sampling.n)
        try:
            while True:
                items = [await seq.out.get()]
                while not seq.out.empty():  # coalesce what piled up while the consumer was busy
                    items.append(seq.out.get_nowait())
                tokens: list[int] = []
                finish = None
                for item in items:
                    if item is _ABORTED:
                        finish = "abort"
                        break
                    tokens.append(item[0])
                    finish = item[1] or finish
                text = bytes(tokens).decode("utf-8", "replace")
                # n choices: the same deterministic text each (one sequence's timing; see the module doc).
                for i in range(n):
                    chunk = GenerationChunk(token_ids=list(tokens), text=text, choice=i, finish_reason=finish)
                    if finish and i == n - 1:
                        chunk.done = True
                        chunk.kv_transfer = {
                            "remote_prefill": seq.remote_kv,
                            "num_cached_tokens": len(req.prompt_token_ids) if seq.remote_kv else seq.cached,
                            "source_engine": (kv_handle or {}).get("engine_id"),
                        }
                    yield chunk
                if finish:
                    return
        finally:
            self._drop(req.request_id)

    async def abort(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._drop(request_id)
            seq.out.put_nowait(_ABORTED)

    def stats(self) -> EngineStats:
        # As vLLM counts them: a prompt is waiting until a step takes it, running from then on (chunked or not).
        started = sum(1 for seq in self._waiting if seq.scheduled)
        return EngineStats(running=len(self._running) + started, waiting=len(self._waiting) - started, kv_usage=0.0)

    def progress(self) -> tuple[int, int] | None:
        return len(self._by_id), self._steps

    def computed_tokens(self, request_id: str) -> int | None:
        seq = self._by_id.get(request_id)
        return None if seq is None else seq.prefilled

    def failure(self) -> str | None:
        task = self._loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            return f"the sim engine's step loop failed: {task.exception()!r}"
        return None

    def _admit(self, req: EngineRequest, prefill_only: bool, remote_kv: bool) -> _Seq:
        seq = _Seq(req, prefill_only, remote_kv)
        seq.start = _output_start(req.prompt_token_ids)
        self._by_id[req.request_id] = seq
        if self.cache and not remote_kv:
            seq.cached = seq.prefilled = self.cache.cached_tokens(req.prompt_token_ids, _salt(req))
        if remote_kv and req.adapter is not None and not self._activate(seq, self._active_adapters()):
            seq.prefilled = len(req.prompt_token_ids)  # pulled, but its adapter waits for a slot
            self._waiting.append(seq)
        elif remote_kv:
            seq.prefilled = len(req.prompt_token_ids)  # pulled: held, and cached, as computed here
            self._running.append(seq)  # KV arrives from the prefill engine: straight to decode
        else:
            self._waiting.append(seq)
        self._wake.set()
        return seq

    def _drop(self, request_id: str) -> None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return
        if self.cache and seq.prefilled >= len(seq.req.prompt_token_ids):  # its blocks stay cached, as in vLLM
            self.cache.store(seq.req.prompt_token_ids + list(seq.text), _salt(seq.req))
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)

    async def _step_loop(self) -> None:
        t = self.timing
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            if self._waiting:
                # Like vLLM's priority policy: lower priority value first, then arrival.
                order = sorted(self._waiting, key=lambda q: q.req.priority)
                chunks, budget = [], t.max_batch_tokens
                active = self._active_adapters()
                for seq in order:
                    if not self._activate(seq, active):
                        continue  # its adapter would be one too many in this step: it waits for a slot
                    take = min(budget, len(seq.req.prompt_token_ids) - seq.prefilled)
                    chunks.append((seq, take))
                    seq.scheduled = True
                    budget -= take
                    if budget <= 0:
                        break
                if not chunks:  # every waiting prompt waits for an adapter slot: decode until one frees
                    await self._decode_step()
                    continue
                tokens = sum(n for _, n in chunks)
                load_s, self._load_due_s = self._load_due_s, 0.0
                await asyncio.sleep(t.prefill_base_s + t.prefill_per_token_s * tokens + load_s)
                self._steps += 1
                for seq, take in chunks:
                    if seq.req.request_id not in self._by_id:
                        continue  # aborted during the step
                    seq.prefilled += take
                    if seq.prefilled < len(seq.req.prompt_token_ids):
                        continue
                    self._waiting.remove(seq)
                    if self.cache:  # a prompt's full blocks are cached once computed, as in vLLM
                        self.cache.store(seq.req.prompt_token_ids, _salt(seq.req))
                    if seq.prefill_only:
                        self._drop(seq.req.request_id)
                        seq.out.put_nowait((0, None))
                    else:
                        self._running.append(seq)
                        self._emit(seq)  # the prefill step also samples the first token
            else:
                await self._decode_step()

    async def _decode_step(self) -> None:
        t = self.timing
        load_s, self._load_due_s = self._load_due_s, 0.0
        await asyncio.sleep(t.decode_base_s + t.decode_per_seq_s * len(self._running) + load_s)
        self._steps += 1
        for seq in list(self._running):
            self._emit(seq)

    def _emit(self, seq: _Seq) -> None:
        token = _token_at(seq.start, seq.produced)
        seq.produced += 1
        seq.text += bytes([token])
        sampling = seq.req.sampling
        finish = None
        if any(s and s.encode() in seq.text for s in sampling.stop):
            finish = "stop"
        elif seq.produced >= sampling.max_tokens:
            finish = "length"
        if finish:
            self._drop(seq.req.request_id)
        seq.out.put_nowait((token, finish))


# What the sim cannot produce: it has no model, so no probabilities and no grammar. Refused, not faked.
_NOT_COMPUTED = {"logprobs": "logprobs", "logprob_token_ids": "logprobs", "prompt_logprobs": "prompt_logprobs",
                 "structured_outputs": "structured outputs (response_format, guided decoding)"}


def _refuse_what_sim_cannot_compute(req: EngineRequest) -> None:
    params = req.sampling.params or {}
    for key, what in _NOT_COMPUTED.items():
        if params.get(key) is not None:
            raise RequestRefused(f"the sim engine has no model, so it does not compute {what}; "
                                 "serve this request with the vllm engine", param=key)


def _refuse_adapter_without_lora(req: EngineRequest, slots: int) -> None:
    if req.adapter is not None and slots <= 0:
        raise RequestRefused(f"the model `{req.adapter.name}` is a LoRA adapter and this engine runs without LoRA "
                             "([engine] sim_max_loras = 0)", param="model")


def _salt(req: EngineRequest) -> str | None:
    """The prefix-cache key's salt: the request's cache_salt and its adapter (blocks computed with an
    adapter are another adapter's or the base model's never)."""
    if req.adapter is None:
        return req.cache_salt
    return f"{req.cache_salt or ''}\0lora:{req.adapter.name}:{req.adapter.lora_id}"


def _output_start(prompt_token_ids: list[int]) -> int:
    """Output depends on the first tokens of the context and on the position, like
    a greedy model: a request resumed elsewhere with prompt + output so far
    (migration) continues with exactly the tokens it would have produced."""
    head = bytes(str(prompt_token_ids[:8]), "ascii")
    return int.from_bytes(hashlib.blake2b(head, digest_size=4).digest(), "big") + len(prompt_token_ids)


def _token_at(start: int, k: int) -> int:
    return _TEXT[(start + k) % len(_TEXT)]


def expected_output(prompt_token_ids: list[int], max_tokens: int) -> bytes:
    """What the sim engine generates for a prompt without stop strings: lets a test
    or the churn benchmark check an output for gaps and duplicates."""
    start = _output_start(prompt_token_ids)
    return bytes(_token_at(start, k) for k in range(max_tokens))
