"""What `skyline up` shows on the terminal while every child's full output goes to its log file.

`LineFilter` picks, line by line, what a newcomer needs to see from one process: errors always
(an engine that fails to load must show at once), warnings (each distinct one once during
start-up), Skyline's own INFO lines (the request log) once the fleet is up, and the lines a shown
record carries with it (tracebacks). vLLM's INFO start-up chatter stays in the file. `Console`
writes those lines and the progress lines from several threads, with one live spinner line at the
bottom when stdout is a terminal.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
from collections import deque
from pathlib import Path
from typing import NamedTuple

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # vLLM colours its level words when forced to (FORCE_COLOR)
_LEVEL = r"(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)"
# The log line formats of the processes `skyline up` starts, each giving a level (and maybe a logger).
_HEADERS = (
    # skyline/core/logs.py TEXT_FORMAT (Skyline, uvicorn, RQ): "2026-01-02 03:04:05,678 INFO skyline.events: ..."
    re.compile(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ {_LEVEL} (?P<logger>[^\s:]+): "),
    # vllm/logger.py: "(EngineCore_DP0 pid=12) INFO 01-02 03:04:05 [core.py:93] ..." (an optional prefix first)
    re.compile(rf"\([^()]* pid=\d+\) {_LEVEL} \d\d-\d\d \d\d:\d\d:\d\d "),
    # vLLM's format before it named the process: "INFO 01-02 03:04:05 [core.py:93] ..."
    re.compile(rf"^{_LEVEL} \d\d-\d\d \d\d:\d\d:\d\d "),
)
# glog/abseil, as C++ libraries under vLLM (NIXL) write: "W0102 03:04:05.678901  12 file.cc:34] ..."
_GLOG = re.compile(r"^(?P<letter>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Anything else that says it is a warning or an error near its start ("WARNING: ...", "UCX  ERROR ...").
_LEVEL_WORD = re.compile(r"(?<![\w.])(WARNING|WARN|ERROR|CRITICAL|FATAL)(?![\w.])")
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "FATAL": logging.CRITICAL}


class Record(NamedTuple):
    level: int
    logger: str  # "" where the format names none (vLLM's names the file)
    message: str  # what follows the header: the same warning from two processes has the same message


def classify(line: str) -> Record | None:
    """The level, logger and message of a log record's first line; None for a line without a
    header (a traceback line, a multi-line message's continuation, a progress bar, a plain print)."""
    line = _ANSI.sub("", line)
    if line.startswith("{"):  # --log-format json (skyline/core/logs.py): "level" and "logger" keys
        try:
            rec = json.loads(line)
            return Record(_LEVELS.get(str(rec["level"]).upper(), logging.INFO), str(rec.get("logger", "")),
                          str(rec.get("msg", rec.get("event", ""))))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    for header in _HEADERS:
        if m := header.search(line):
            message = line[m.end():]
            if m.groupdict().get("logger") is None:  # vLLM: "[core.py:93] message"
                message = message.split("] ", 1)[-1]
            return Record(_LEVELS[m["level"]], m.groupdict().get("logger") or "", message)
    if m := _GLOG.match(line):
        return Record(_GLOG_LEVELS[m["letter"]], "", line[m.end():])
    if m := _LEVEL_WORD.search(line[:100]):
        return Record(_LEVELS[m[1]], "", line[m.end():])
    return None


def is_own(logger: str) -> bool:
    return logger == "skyline" or logger.startswith("skyline.")


# Lines that open (part of) a traceback Python printed itself, without a logger's header.
_TRACEBACK = ("Traceback (most recent call last)", "During handling of the above exception",
              "The above exception was the direct cause")


# Warnings every start of the default fleet on a CPU host prints, none of which asks anything of the
# operator: facts of the CPU build, or choices Skyline made on purpose (eager mode, kv_both, its
# scheduler class; docs/vllm-on-cpu.md). Kept in the log files, not shown while the fleet starts.
EXPECTED_AT_START = (
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Reset SSM cache type to float32",
    "Model Runner V2 requires Triton",
    "we can't reset UCX_RCACHE_MAX_UNRELEASED",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    "is not found in LD_PRELOAD",
    "Initializing KVConnectorBase_V1. This API is experimental",
    "Using kv_role='kv_both' with NixlConnector is deprecated",
    "Using custom scheduler class skyline.workers.engines.vllm_scheduler",
)


def expected_at_start(message: str) -> bool:
    return any(known in message for known in EXPECTED_AT_START)


class Seen:
    """Warnings already shown during start-up, fleet-wide: vLLM repeats the same ones in every
    engine process (front end, EngineCore, worker) of every worker, and each tells the operator
    nothing new after the first. Errors are never held back; after the banner nothing is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: set[str] = set()

    def first(self, message: str) -> bool:
        with self.lock:
            new = message not in self.messages
            self.messages.add(message)
            return new


class LineFilter:
    """Which lines of one process reach the terminal when `skyline up` is not --verbose."""

    def __init__(self, seen: Seen | None = None) -> None:
        self.seen = seen or Seen()
        self.follow = False  # the last record was shown: its header-less lines (a traceback) go with it
        self.frames = False  # the last line was indented: a traceback's frames

    def show(self, line: str, fleet_up: bool) -> bool:
        rec = classify(line)
        if rec is not None:
            if rec.level >= logging.ERROR or (fleet_up and rec.level >= logging.INFO and is_own(rec.logger)):
                self.follow = True
            elif rec.level >= logging.WARNING:
                self.follow = fleet_up or (not expected_at_start(rec.message) and self.seen.first(rec.message.strip()))
            else:
                self.follow = False
            self.frames = False
            return self.follow
        if line.startswith(_TRACEBACK):
            self.follow = True
        shown = self.follow and "\r" not in line  # never a progress bar redrawn in place
        if self.frames and line and not line[0].isspace():
            self.follow = False  # "ValueError: ..." after the frames ends the traceback
        self.frames = line[:1].isspace()
        return shown


def tail(path: Path, n: int = 20) -> list[str]:
    """The last `n` lines of a log file (what to show when its process dies)."""
    try:
        with open(path, "rb") as fh:
            return [raw.decode(errors="replace").rstrip("\r\n") for raw in deque(fh, maxlen=n)]
    except OSError:
        return []


def rotate(path: Path) -> Path:
    """Start `path` afresh, keeping the previous start's log as `<path>.1` (one generation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.replace(path.with_name(path.name + ".1"))
    return path


class Console:
    """The terminal of `skyline up`: whole lines from any thread, and on a TTY one live status
    line kept below them (redrawn with a carriage return). Elsewhere (a pipe, CI, the tests)
    there is no status line at all: only whole lines, so a log of the terminal stays readable."""

    FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, stream=None, live: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.lock = threading.Lock()
        self.status = ""
        self.frames = self.FRAMES if "utf" in (getattr(self.stream, "encoding", "") or "").lower() else "-\\|/"
        self.tick = 0

    def line(self, text: str) -> None:
        with self.lock:
            try:
                self._erase()
                self.stream.write(text + "\n")
                if self.status:
                    self.stream.write(self.status)
                self.stream.flush()
            except OSError:  # the terminal is gone (a closed pipe): the log files must still get every line
                pass

    def spin(self, text: str) -> None:
        """Show `text` behind the next spinner frame (a no-op unless live)."""
        if not self.live:
            return
        self.tick += 1
        width = shutil.get_terminal_size().columns - 1  # a wrapped status line could not be redrawn
        with self.lock:
            self._erase()
            self.status = f"{self.frames[self.tick % len(self.frames)]} {text}"[:width]
            self.stream.write(self.status)
            self.stream.flush()

    def done(self) -> None:
        """Remove the status line (before the banner, or when stopping)."""
        with self.lock:
            self._erase()
            self.status = ""
            self.stream.flush()

    def _erase(self) -> None:
        if self.status:
            self.stream.write("\r\x1b[K")
