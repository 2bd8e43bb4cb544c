"""Wire messages: typed classes with one MessagePack codec.

Every message that crosses Redis is one of the dataclasses below. `encode`
writes a two-element array ``[type_tag, {field: value}]`` so a reader can tell
the type without context and so fields can be added without breaking old
readers (unknown fields are ignored, missing ones take their defaults).

Internal state (engine objects, asyncio tasks) never goes on the wire; the
workers and the gateway convert at their edges.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack


@dataclass
class SamplingSpec:
    """Sampling as the fleet sees it.

    `params` is the request's complete vLLM `SamplingParams` (as plain builtins,
    `msgspec.to_builtins`), built by vLLM's own request models in the gateway: a
    vLLM engine runs exactly those. The named fields are the part Skyline's own
    code reads (scheduling, migration, the sim engine); they are copied from
    `params` at the gateway, and `max_tokens` is the one a worker may lower (a
    migrated stream continues with what is left).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled (vLLM uses -1 or 0 for "all tokens")
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1  # choices; vLLM's own `n` in one engine (the prompt's KV is shared by them)
    params: dict[str, Any] | None = None  # vLLM SamplingParams builtins; None = only the fields above


@dataclass
class AdapterRef:
    """The LoRA adapter a request runs with (vLLM's LoRARequest, as the fleet's adapter registry
    gives it: skyline/core/adapters.py). `lora_id` is fleet-wide: each load of a name gets a new one,
    so an engine never serves a reloaded adapter with the weights it kept under the old id."""

    name: str
    lora_id: int
    path: str


@dataclass
class GenerateRequest:
    """A request as the gateway enqueues it on a tier stream.

    `arrival_ms` and `deadline_ms` are wall-clock milliseconds (Unix epoch) so
    that every process on every host agrees on them; deadline = arrival + TTFT
    target. `attempt` counts deliveries of this request id to a worker that
    restarted it (used for fencing by the reliability layer).
    """

    TAG: ClassVar[str] = "req"

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    tier: str
    arrival_ms: int
    deadline_ms: int
    ttft_ms: int
    tpot_ms: int
    priority: int = 0
    route: str = "disagg"  # "disagg": prefill worker then decode worker; "colocated": decode worker does both
    attempt: int = 0
    preemptions: int = 0  # times a prefill worker aborted and re-queued it for a stricter request
    cache_salt: str | None = None  # vLLM's per-request prefix-cache salt: hits only other requests with the same salt
    # The client asked for no SLO (no tier, no target): it is queued in its default tier's order, but
    # neither shed for that tier's TTFT target nor dropped for lateness, as `vllm serve` would serve it;
    # refused only past [gateway] best_effort_max_wait_s of predicted wait, or at the queue bound.
    best_effort: bool = False
    # The LoRA adapter the request names as its `model` (None: the base model). Prefill and decode
    # engines both run it: KV computed with an adapter is decoded with it.
    adapter: AdapterRef | None = None
    # The W3C trace context of the gateway's span of this request (`traceparent`, `tracestate`), when
    # the gateway exports traces: every worker's spans of it join the same trace (skyline/core/tracing.py).
    trace: dict[str, str] | None = None


@dataclass
class DecodeWork:
    """A request whose prompt was prefilled, with the KV-block handle to pull.

    `kv_handle` is vLLM's `kv_transfer_params` as returned by the prefill
    engine (engine id, block ids, host, port, ...); it is opaque to Skyline.
    `kv_handle` is None when the request was routed colocated: the decode
    worker then prefills the prompt itself.
    """

    TAG: ClassVar[str] = "decode"

    request: GenerateRequest
    kv_handle: dict[str, Any] | None = None
    prefill_worker: str = ""
    prefill_started_ms: int = 0
    prefill_finished_ms: int = 0
    # Prompt logprobs computed where the prompt was computed (the prefill engine), when asked
    # for: the decode engine only pulls the KV and never sees the prompt's logits.
    prompt_logprobs: list | None = None
    # Why an elastic worker handed this decode on instead of decoding it itself (scheduler/elastic.py
    # `decoder_for`); "" from a prefill worker, which always hands on.
    decode_placed: str = ""


@dataclass
class TokenDelta:
    """New output of one choice of a request: token ids and the text they decode to.

    `seq` counts frames from 0 per request so the gateway can detect gaps and
    drop duplicates; `index` is the number of tokens streamed before this
    frame (the position of `token_ids[0]` in the output) over all choices.
    `logprobs` has one entry per token, each a list of
    `[token_id, logprob, rank, decoded_token]` (the sampled token first, then
    the top ones), as vLLM's `Logprob`s; `prompt_logprobs` (first frame only)
    has one such entry, or None, per prompt token. `finish_reason` and
    `stop_reason` close this choice (the request ends with `Finished`).
    """

    TAG: ClassVar[str] = "delta"

    request_id: str
    seq: int
    index: int
    token_ids: list[int]
    text: str
    choice: int = 0
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None


@dataclass
class Finished:
    """The last frame of a successful request: why it stopped, usage, timings."""

    TAG: ClassVar[str] = "final"

    request_id: str
    seq: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    kv_transfer: dict[str, Any] = field(default_factory=dict)
    decode_worker: str = ""
    prefill_worker: str = ""
    # Decode attempts: > 1 when the request migrated (its decode worker died or
    # stalled mid-stream and another one resumed the stream).
    attempts: int = 1
    resumed_at_token: int = 0  # output tokens already streamed when the last attempt took over


@dataclass
class Failed:
    """The last frame of a failed request: an OpenAI-style error for the client."""

    TAG: ClassVar[str] = "error"

    request_id: str
    seq: int
    status: int
    message: str
    type: str = "server_error"
    code: str | None = None


@dataclass
class Cancel:
    """Broadcast on the cancel channel when a client goes away."""

    TAG: ClassVar[str] = "cancel"

    request_id: str
    reason: str = "client_disconnected"


Message = GenerateRequest | DecodeWork | TokenDelta | Finished | Failed | Cancel
_BY_TAG: dict[str, type] = {
    cls.TAG: cls for cls in (GenerateRequest, DecodeWork, TokenDelta, Finished, Failed, Cancel)
}
_NESTED: dict[tuple[type, str], type] = {
    (GenerateRequest, "sampling"): SamplingSpec,
    (DecodeWork, "request"): GenerateRequest,
    (GenerateRequest, "adapter"): AdapterRef,
}


class CodecError(ValueError):
    """A payload that is not a Skyline message (wrong type tag or shape)."""


_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (*_BY_TAG.values(), SamplingSpec, AdapterRef)
}
_FIELD_SET: dict[type, frozenset[str]] = {cls: frozenset(names) for cls, names in _FIELDS.items()}


def encode(msg: Message) -> bytes:
    return msgpack.packb([msg.TAG, _as_dict(msg)], use_bin_type=True)


def _as_dict(msg: Any) -> dict[str, Any]:
    """`dataclasses.asdict` without its deep copy (msgpack only reads the values; on the hot path of
    every request and frame): the nested messages of `_NESTED` become dicts, other values go as they are."""
    cls = type(msg)
    out = {name: getattr(msg, name) for name in _FIELDS[cls]}
    for (owner, name) in _NESTED:
        if owner is cls and out[name] is not None:
            out[name] = _as_dict(out[name])
    return out


def decode(payload: bytes) -> Message:
    try:
        tag, fields = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        cls = _BY_TAG[tag]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise CodecError(f"not a Skyline message: {exc}") from exc
    return _build(cls, fields)


def _build(cls: type, fields: dict[str, Any]) -> Any:
    known = _FIELD_SET[cls]
    kwargs = {}
    for name, value in fields.items():
        if name not in known:
            continue  # written by a newer peer; ignore
        nested = _NESTED.get((cls, name))
        kwargs[name] = _build(nested, value) if nested and isinstance(value, dict) else value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise CodecError(f"bad {cls.__name__}: {exc}") from exc
