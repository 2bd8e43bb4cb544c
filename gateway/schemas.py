"""Request bodies of /v1/completions and /v1/chat/completions (pydantic, HTTP edge only).

The models accept the OpenAI fields Skyline can honour, ignore unknown extra
fields (clients send many harmless ones), and reject with a 400 the fields
whose meaning we cannot honour (`n` > 1, `logprobs`, `echo`, `best_of` > 1,
tools) instead of silently returning something else than was asked. After
validation the gateway only deals with `sampling()` and the normalized prompt;
the wire messages (`skyline.messages`) never see these classes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from skyline.messages import SamplingSpec

MAX_STOP = 4  # OpenAI's limit on stop sequences


class SloSpec(BaseModel):
    """Skyline extension: `"slo": {"tier": "interactive", "ttft_ms": 500, "tpot_ms": 100}`.

    Targets may only tighten the tier's (see `skyline.scheduler.tiers.resolve_slo`).
    The headers `x-slo-tier`, `x-slo-ttft-ms`, `x-slo-tpot-ms` take precedence.
    """

    model_config = ConfigDict(extra="ignore")

    tier: str | None = None
    ttft_ms: int | None = Field(default=None, gt=0)
    tpot_ms: int | None = Field(default=None, gt=0)
    allow_demotion: bool = False  # header x-slo-allow-demotion: true


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; -1/0 = disabled
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    ignore_eos: bool = False  # vLLM extension (benchmarks use it to fix the output length)
    user: str | None = None
    slo: SloSpec | None = None
    # Accepted only at their no-op values; anything else is a 400 (see _reject_unsupported).
    best_of: int | None = None
    echo: bool | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(v)}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported by Skyline, got n={v}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise ValueError("best_of > 1 is not supported by Skyline")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported by Skyline")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tool/function calling is not supported by Skyline")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("type", "text") != "text":
            raise ValueError(f"response_format {v.get('type')!r} is not supported by Skyline (only 'text')")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int) -> SamplingSpec:
        """The engine-facing sampling parameters; OpenAI defaults where the client sent none."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingSpec(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=[],
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )


class CompletionRequest(_Common):
    """POST /v1/completions. `prompt`: a string, a list of exactly one string, or token ids."""

    prompt: str | list[int]
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            if len(v) == 1 and isinstance(v[0], str):
                return v[0]  # a batch of one prompt
            if v and all(isinstance(t, str) for t in v):
                raise ValueError("batched prompts are not supported by Skyline: "
                                 f"send one prompt per request (got {len(v)})")
            if v and all(type(t) is int for t in v):
                if min(v) < 0:
                    raise ValueError("token ids must be non-negative integers")
                return v
            if v and all(isinstance(t, list) for t in v):
                raise ValueError("batched token-id prompts are not supported by Skyline: send one prompt per request")
        raise ValueError("must be a string, a list with one string, or a non-empty list of token ids")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs is not supported by Skyline")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by Skyline")
        return v

    def prompt_chars(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else 0


# Validators raise ValueError even for wrong types: pydantic turns ValueError (not
# TypeError) into a ValidationError, which the gateway reports as a 400 naming the field.


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        """Normalize OpenAI content parts to one string: the chat template wants text."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict):
                    raise ValueError("content parts must be objects")
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported by Skyline (only 'text')")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a string 'text'")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("must be a string or a list of text content parts")

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"unknown role {v!r}")
        return v


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs is not supported by Skyline")
        return v

    @model_validator(mode="after")
    def _no_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported by Skyline")
        return self

    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts with string content, ready for the chat template."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out

    def prompt_chars(self) -> int:
        return sum(len(m.content or "") for m in self.messages)
