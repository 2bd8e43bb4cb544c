"""A Skyline config file with some values changed: how a bench system that differs from another in
one setting (`skyline-no-affinity`: `[gateway] prefix_affinity = false`) starts its processes.

Skyline's processes read one TOML file (`--config`), and the bench's `--skyline-config` may name
one already: the system's file is that one's values with the changes applied, written anew (the
standard library reads TOML but does not write it; the config's values are tables, strings,
numbers, booleans and arrays of them, which is all this writes).
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def with_changes(base: str, changes: dict[str, dict[str, Any]], path: Path) -> str:
    """Write `base` (a TOML file; "" = the defaults) with `changes` ({section: {key: value}}) applied to
    `path` (tables within a section merged); returns the path as a string, for `--config`."""
    data: dict[str, Any] = {}
    if base:
        with open(base, "rb") as fh:
            data = tomllib.load(fh)
    for section, values in changes.items():
        _merge(data.setdefault(section, {}), values)
    path.write_text(dumps(data))
    return str(path)


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    """Tables within a section (`[engine.vllm]`) merge key by key; other values replace."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def dumps(data: dict[str, Any]) -> str:
    """TOML text of `data`: top-level keys first, then one [table] per nested table."""
    return "\n".join(_table(data, ())) + "\n"


def _table(data: dict[str, Any], name: tuple[str, ...]) -> list[str]:
    lines = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    if name and (lines or not data):  # an empty table too (`[engine.vllm]` with every line a comment)
        lines.insert(0, f"[{'.'.join(map(_key, name))}]")
    for k, v in data.items():
        if isinstance(v, dict):
            lines += _table(v, (*name, k))
    return lines


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k, ensure_ascii=False)


def _value(v: Any) -> str:
    if isinstance(v, bool):  # (before int: a bool is an int)
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        # JSON's string escapes are TOML's basic-string escapes; TOML also wants DEL escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")
