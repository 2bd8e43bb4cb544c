"""An OpenAI streaming client that records what a benchmark needs per request.

Definitions follow `vllm bench serve`: TTFT = first content chunk - send;
ITL = gaps between content chunks; TPOT = (latency - TTFT) / (output tokens - 1).
Output tokens come from the server's usage (stream_options.include_usage).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestRecord:
    ok: bool = False
    status: int = 0
    error: str = ""
    # Where the error came from: "status" (HTTP error answer), "frame" (error event in
    # the stream: the server told the client) or "transport" (connection broke, timeout).
    error_source: str = ""
    error_code: str = ""  # the OpenAI error object's `code` ("redis_state_lost", ...), when it has one
    sent: float = 0.0  # time.perf_counter() at send
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    # usage.prompt_tokens_details.cached_tokens: prompt tokens the server's prefix cache served
    # (vLLM reports it with --enable-prompt-tokens-details); None when the server does not say.
    cached_tokens: int | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds after `sent`
    text: str = ""  # the streamed output, concatenated
    skyline: dict = field(default_factory=dict)  # the gateway's extension object, when present

    @property
    def tpot_s(self) -> float:
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> RequestRecord:
    """POST a streaming (chat) completion and time it; never raises for HTTP/transport errors."""
    rec = RequestRecord(sent=time.perf_counter())
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error, rec.error_source, rec.error_code = body[:500], "status", _error_code(body)
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error")
                    rec.error_source = "frame"
                    rec.error_code = str(chunk["error"].get("code") or "")
                    return rec
                now = time.perf_counter() - rec.sent
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        rec.ttft_s = rec.ttft_s or now
                        rec.chunk_times.append(now)
                        rec.text += piece
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                if chunk.get("skyline"):
                    rec.skyline = chunk["skyline"]
        rec.latency_s = time.perf_counter() - rec.sent
        rec.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        rec.error_source = "transport"
    return rec


def _error_code(body: str) -> str:
    """The `code` of an OpenAI error answer; "" when the body is not one."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""
