"""Batch input files and output lines, in OpenAI's Batch API format (pure; no I/O).

Input: one JSON object per line,
  {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Blank lines are not requests. Lines are numbered from 1, as in an editor and
in OpenAI's `errors.data[].line`; a batch's progress and its output are keyed
by these numbers.

Output: one line per request line, in input order, split the way OpenAI
splits them: a 2xx answer goes to the output file,
  {"id": "batch_req_...", "custom_id": "req-1",
   "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
anything else to the error file, either with the HTTP error the request got
(`response.status_code` 4xx and the OpenAI error body) or, when the line never
became a request (bad JSON, cancelled, ...), with `response: null` and
`error: {"code", "message"}`.

A problem with one line is that line's error; only problems that make the
whole batch meaningless (no request at all, duplicate custom_ids so results
could not be told apart, too many lines) stop it from starting.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_REPORTED_ERRORS = 100  # batch-level errors kept in the batch object; every line's error is in the error file
MAX_CUSTOM_ID_CHARS = 512
# Answers that are not a line's result but "busy or down, try later": the runner retries these.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class BatchLine:
    """A request line that can be sent."""

    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    line: int | None
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def as_batch_error(self) -> dict[str, Any]:
        """The entry of a batch object's `errors.data`."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class ParsedInput:
    requests: list[BatchLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)  # bad lines: reported in the error file
    fatal: list[LineError] = field(default_factory=list)  # reasons the batch cannot start

    @property
    def total(self) -> int:
        """Request lines (good or bad): the batch's `request_counts.total`, one output line each."""
        return len(self.requests) + len(self.errors)

    def custom_ids(self) -> dict[int, str | None]:
        """line -> custom_id (None where a bad line has none), for every request line."""
        out: dict[int, str | None] = {r.line: r.custom_id for r in self.requests}
        out.update({e.line: e.custom_id for e in self.errors if e.line is not None})
        return dict(sorted(out.items()))


def count_lines(content: bytes) -> int:
    """Non-blank lines: what the line limit counts."""
    return sum(1 for raw in content.split(b"\n") if raw.strip())


def parse_input(content: bytes, endpoint: str, max_lines: int) -> ParsedInput:
    """Split a batch input file into sendable requests, bad lines, and batch-level problems."""
    out = ParsedInput()
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        item = _parse_line(number, raw, endpoint)
        if isinstance(item, LineError):
            out.errors.append(item)
            continue
        if item.custom_id in first_line_of:
            out.fatal.append(LineError(number, item.custom_id, "duplicate_custom_id",
                                       f"custom_id {item.custom_id!r} is also used on line "
                                       f"{first_line_of[item.custom_id]}; results could not be told apart",
                                       "custom_id"))
            continue
        first_line_of[item.custom_id] = number
        out.requests.append(item)
    if out.total == 0:
        out.fatal.append(LineError(None, None, "empty_file", "the input file has no request lines"))
    elif out.total > max_lines:
        out.fatal.append(LineError(None, None, "too_many_lines",
                                   f"the input file has {out.total} request lines; the limit is {max_lines}"))
    elif not out.requests and not out.fatal:
        out.fatal.append(LineError(None, None, "no_valid_requests",
                                   f"none of the {out.total} lines is a valid request; the first problems follow"))
        out.fatal += out.errors
    del out.fatal[MAX_REPORTED_ERRORS:]
    return out


def _parse_line(number: int, raw: bytes, endpoint: str) -> BatchLine | LineError:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return LineError(number, None, "invalid_json_line", f"line {number} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return LineError(number, None, "invalid_json_line", f"line {number} is not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
        return LineError(number, None, "missing_custom_id",
                         f"line {number}: custom_id must be a non-empty string of at most "
                         f"{MAX_CUSTOM_ID_CHARS} characters", "custom_id")

    def bad(code: str, message: str, param: str) -> LineError:
        return LineError(number, cid, code, f"line {number}: {message}", param)

    if obj.get("method") != "POST":
        return bad("invalid_method", f"method must be \"POST\", got {obj.get('method')!r}", "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return bad("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
    if url != endpoint:
        return bad("mismatched_url", f"url {url!r} differs from the batch's endpoint {endpoint!r}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "body must be a JSON object (the request to send)", "body")
    if body.get("stream"):
        return bad("invalid_body", "streaming is not available in a batch; remove \"stream\"", "body.stream")
    return BatchLine(number, cid, url, body)


# ---- output lines ---------------------------------------------------------------------------


def _line_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def response_line(custom_id: str | None, status_code: int, request_id: str | None, body: Any) -> dict[str, Any]:
    """The output line of a request that got an HTTP answer (2xx: output file; else error file)."""
    return {"id": _line_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The output line of a line that never got an answer (bad line, given up, cancelled, expired)."""
    return {"id": _line_id(), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}


def is_success(line: dict[str, Any]) -> bool:
    resp = line.get("response")
    return line.get("error") is None and isinstance(resp, dict) and 200 <= int(resp.get("status_code", 0)) < 300


def dumps(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False)


def usage_of(line: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a successful line's response body, else zeros."""
    if not is_success(line):
        return 0, 0
    usage = (line["response"].get("body") or {}).get("usage") or {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
