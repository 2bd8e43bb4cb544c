"""OpenAI file and batch objects, from the Redis hashes that hold them (pure).

A batch hash keeps each field of the OpenAI batch object as a string (JSON
for `errors`, `metadata`, `usage`; decimal Unix seconds for timestamps) plus
the request counters `total`, `completed`, `failed` that results increment.
"""

from __future__ import annotations

import json
from typing import Any

STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
TERMINAL = ("failed", "completed", "expired", "cancelled")
TIMESTAMPS = ("created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")
COMPLETION_WINDOWS = {"24h": 86_400}


def _text(raw: dict) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


def batch_object(raw: dict) -> dict[str, Any]:
    """The OpenAI batch object of a batch hash (as HGETALL returns it)."""
    h = _text(raw)
    errors = json.loads(h["errors"]) if h.get("errors") else None
    out: dict[str, Any] = {
        "id": h["id"],
        "object": "batch",
        "endpoint": h["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": h["input_file_id"],
        "completion_window": h["completion_window"],
        "status": h["status"],
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
    }
    for name in TIMESTAMPS:
        out[name] = int(h[name]) if h.get(name) else None
    out["request_counts"] = {k: int(h.get(k) or 0) for k in ("total", "completed", "failed")}
    out["metadata"] = json.loads(h["metadata"]) if h.get("metadata") else None
    out["usage"] = json.loads(h["usage"]) if h.get("usage") else None
    return out


def file_object(raw: dict) -> dict[str, Any]:
    """The OpenAI file object of a file hash."""
    h = _text(raw)
    return {
        "id": h["id"],
        "object": "file",
        "bytes": int(h["bytes"]),
        "created_at": int(h["created_at"]),
        "expires_at": int(h["expires_at"]) if h.get("expires_at") else None,
        "filename": h["filename"],
        "purpose": h["purpose"],
        "status": "processed",
        "status_details": None,
    }


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}
