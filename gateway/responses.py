"""OpenAI response shapes: non-stream bodies and SSE chunks for both endpoints.

Content chunks are the hot path (one per frame, thousands per second), so
they are built by concatenating a pre-encoded prefix and suffix around the
JSON-escaped text rather than by serializing a fresh dict each time. The rare
chunks (role, finish, usage, error) go through `json.dumps`.
"""

from __future__ import annotations

import json
from typing import Any

from skyline import messages

DONE = b"data: [DONE]\n\n"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_event(frame: messages.Failed) -> bytes:
    """An SSE error event: the `openai` client raises APIError on `{"error": ...}` data."""
    return sse({"error": {"message": frame.message, "type": frame.type, "param": None,
                          "code": frame.code if frame.code is not None else frame.status}})


class Shaper:
    """Builds every body and chunk of one request (chat or completion)."""

    def __init__(self, kind: str, request_id: str, model: str, created: int):
        self.chat = kind == "chat"
        self.head = {"id": request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": created, "model": model}
        self.body_head = {"id": request_id, "object": "chat.completion" if self.chat else "text_completion",
                          "created": created, "model": model}
        head = _dumps(self.head)[:-1]  # open object, more keys follow
        field = '"delta":{"content":' if self.chat else '"text":'
        self._pre = f'data: {head},"choices":[{{"index":0,{field}'.encode()
        close = "}" if self.chat else ""
        self._post = f'{close},"logprobs":null,"finish_reason":null}}]}}\n\n'.encode()

    def content(self, text: str) -> bytes:
        return self._pre + json.dumps(text, ensure_ascii=False).encode() + self._post

    def role(self) -> bytes:
        """Chat streams open with an assistant role delta (OpenAI does; some clients rely on it)."""
        return sse({**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})

    def finish(self, text: str, finish_reason: str, skyline: dict[str, Any] | None) -> bytes:
        """The last choice chunk: carries the finish reason (and the last text, if it came with it)."""
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if skyline is not None:
            chunk["skyline"] = skyline
        return sse(chunk)

    def usage_chunk(self, use: dict[str, int], skyline: dict[str, Any]) -> bytes:
        """`stream_options.include_usage`: a last chunk with empty choices and the usage."""
        return sse({**self.head, "choices": [], "usage": use, "skyline": skyline})

    def body(self, text: str, finish_reason: str, use: dict[str, int], skyline: dict[str, Any]) -> dict[str, Any]:
        """The non-stream response body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self.body_head, "choices": [choice], "usage": use, "skyline": skyline}
