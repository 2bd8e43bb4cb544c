"""Logging set-up for every Skyline process: `--log-format text|json`.

Text: `time level logger: message`, request events as
`decode_claimed request_id=... worker=... tier=standard`.
JSON: one object per line with `ts`, `level`, `logger`, `msg`, and for
request events (`skyline.core.timeline.EventLine`) `event`, `request_id`,
`worker` and the event's fields as top-level keys, so a log shipper can
index them without parsing the message.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

from skyline.core.timeline import EventLine

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
        }
        if isinstance(record.msg, EventLine):
            out.update(record.msg.as_dict())
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class CurrentStderr(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a record comes, not as it was at setup: the same thing in a
    process of its own; in a test run, where pytest gives each test a stderr of its own and closes it,
    a handler set up by one test would fail on every line logged after it ("I/O operation on closed file")."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once per process (replacing earlier handlers)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = CurrentStderr()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request is noise
