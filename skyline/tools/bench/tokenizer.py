"""Tokenizers the benchmark's prompt builder uses to make prompts of exact lengths.

The gateway itself renders and tokenizes with vLLM's renderer (gateway/openai_api.py).
`SimTokenizer` mirrors the sim model folder's tokenizer and chat template
(skyline/core/sim_model.py): one token per byte.
"""

from __future__ import annotations

import abc
import json
from typing import Any


class Tokenizer(abc.ABC):
    eos_token_ids: tuple[int, ...] = ()

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str: ...

    def encode_answer(self, text: str) -> list[int]:
        """Token ids of a generated answer's text (no special tokens added): what the engine generated,
        near enough (re-tokenizing text may split it differently at a few places)."""
        return self.encode(text)

    @abc.abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat conversation, ending with the assistant prompt."""


class HFTokenizer(Tokenizer):
    """The model's own tokenizer and chat template (transformers)."""

    def __init__(self, model_path: str):
        from transformers import AutoTokenizer  # slow import; only where a real model is served

        self._tok = AutoTokenizer.from_pretrained(model_path)
        eos = self._tok.eos_token_id
        self.eos_token_ids = (eos,) if eos is not None else ()

    def encode(self, text: str) -> list[int]:
        # add_special_tokens matches what vLLM's OpenAI server does for completions.
        return list(self._tok.encode(text, add_special_tokens=True))

    def encode_answer(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already contains the special tokens it needs.
        return list(self._tok.encode(text, add_special_tokens=False))


class SimTokenizer(Tokenizer):
    """Byte-level tokenizer for the `sim` engine: token id = UTF-8 byte value.

    No vocabulary file, so a sim fleet starts in seconds with no model; prompt
    lengths are still realistic enough for scheduling tests (1 token per byte).
    """

    EOS = 256
    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        lines = [f"<|{m.get('role', 'user')}|>{_content_text(m.get('content'))}" for m in messages]
        return self.encode("\n".join(lines) + "\n<|assistant|>")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return json.dumps(content) if content is not None else ""


def load_tokenizer(engine_kind: str, model_path: str) -> Tokenizer:
    return SimTokenizer() if engine_kind == "sim" else HFTokenizer(model_path)
