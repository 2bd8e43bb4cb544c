"""The simulator's hot modules compiled with mypyc: the same source, a faster event loop (docs/simulator.md).

A simulated hour of a 512-GPU fleet is ~16 M events, each a few dozen Python calls spread over the
simulated workers, queues and the policy code of `skyline.scheduler`; no single hot spot is left to
optimise (docs/simulator.md). mypyc compiles those modules, as they are (typed), to C extensions.

Only `skyline simulate` runs them, and only when they were built from exactly the sources in the
tree: the build lives in a folder named after the hash of those sources (`make sim-native` builds it,
`make test` first), and `skyline simulate` starts itself again with `SKYLINE_SIM_NATIVE` naming that
folder, so that the compiled modules are loaded before anything imports the Python ones (a compiled
module checks the classes it is given: it cannot mix with Python twins of its own classes). Edited
sources have another hash: the simulator then runs the Python code, and says so. The gateway, the
workers and the tests always run the Python code; tests/test_simulate_native.py runs the simulator
both ways and checks every result is the same.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.abc import MetaPathFinder
from pathlib import Path

# The modules of the simulated event loop. Not compiled: perf.py (the tests and profiles subclass its
# PerfModel, which a compiled class forbids), and what runs once per run (workload, sessions, summary).
MODULES = (
    "skyline.tools.simulate.events", "skyline.tools.simulate.fleet", "skyline.tools.simulate.decode_worker",
    "skyline.tools.simulate.prefill_worker", "skyline.tools.simulate.elastic_worker",
    "skyline.tools.simulate.queues", "skyline.tools.simulate.request",
    "skyline.tools.simulate.prefix_cache", "skyline.tools.simulate.roofline", "skyline.tools.simulate.preempt",
    "skyline.scheduler.admission", "skyline.scheduler.claiming", "skyline.scheduler.decode_room",
    "skyline.scheduler.edf", "skyline.scheduler.step_budget", "skyline.scheduler.throughput",
    "skyline.scheduler.tiers", "skyline.scheduler.prefix", "skyline.scheduler.disagg",
    "skyline.scheduler.preemption", "skyline.scheduler.elastic", "skyline.tools.bench.verdict",
)
# What mypyc reads besides them, for their types (their imports); copied, not compiled.
CONTEXT_PACKAGES = ("skyline", "skyline.core", "skyline.scheduler", "skyline.tools", "skyline.tools.bench",
                    "skyline.tools.simulate")
EXT = importlib.machinery.EXTENSION_SUFFIXES[0]
MANIFEST = "skyline-native.json"


def _origin(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return Path(spec.origin)


def _package_dir(package: str) -> Path:
    return _origin(package).parent  # its __init__.py's folder (pyproject.toml maps some packages)


def source_hash() -> str:
    """Of the compiled modules' sources and the compiler's version: names the build that matches them."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    try:
        h.update(version("mypy").encode())
    except PackageNotFoundError:
        pass
    for module in MODULES:
        h.update(module.encode() + b"\0" + _origin(module).read_bytes())
    return h.hexdigest()[:16]


def build_root() -> Path:
    """Where builds are kept: in the environment they were compiled for."""
    return Path(sys.prefix) / "skyline-native"


def fresh_build() -> Path | None:
    """The build compiled from the sources as they are, if there is one."""
    folder = build_root() / source_hash()
    return folder if (folder / MANIFEST).exists() else None


def build() -> Path:
    """Compile MODULES (tens of seconds to two minutes) into build_root()/<source hash>/; old builds go."""
    h = source_hash()
    out = build_root() / h
    if (out / MANIFEST).exists():
        return out
    with tempfile.TemporaryDirectory(prefix="skyline-native-") as tmp:
        src = Path(tmp)
        for package in CONTEXT_PACKAGES:  # the tree laid out by import names, as mypyc names its modules
            dest = src.joinpath(*package.split("."))
            dest.mkdir(parents=True, exist_ok=True)
            for f in _package_dir(package).glob("*.py"):
                shutil.copyfile(f, dest / f.name)
        files = [str(Path(*m.split(".")).with_suffix(".py")) for m in MODULES]
        subprocess.run([sys.executable, "-m", "mypyc", "--follow-imports=silent", "--ignore-missing-imports",
                        *files], cwd=src, check=True)
        staging = build_root() / f".{h}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for so in src.rglob(f"*{EXT}"):
            if "build" in so.relative_to(src).parts:
                continue
            (staging / so.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(so, staging / so.relative_to(src))
        missing = [m for m in MODULES if not (staging / (m.replace(".", "/") + EXT)).exists()]
        if missing:
            raise RuntimeError(f"mypyc built no extension for {missing}")
        (staging / MANIFEST).write_text(json.dumps({"modules": list(MODULES), "source_hash": h}))
    for old in build_root().iterdir():
        if old.name != staging.name:
            shutil.rmtree(old, ignore_errors=True)
    staging.rename(out)
    return out


class _CompiledFirst(MetaPathFinder):
    """Finds the compiled build of each of MODULES before Python's finders find its source."""

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MODULES:
            return None
        so = self.folder / (fullname.replace(".", "/") + EXT)
        return importlib.util.spec_from_file_location(fullname, so) if so.exists() else None


def activate(folder: str) -> None:
    """Load MODULES from the build in `folder` from now on. Called by skyline/__init__.py when
    SKYLINE_SIM_NATIVE is set, before any of them is imported."""
    sys.path.insert(0, folder)  # mypyc's shared library of the group is a top-level module there
    sys.meta_path.insert(0, _CompiledFirst(Path(folder)))


def _finder() -> _CompiledFirst | None:
    return next((f for f in sys.meta_path if isinstance(f, _CompiledFirst)), None)


def active() -> bool:
    """Does this process run the compiled modules?"""
    return _finder() is not None


def describe() -> str:
    """Which code this process simulates with, for the command's output."""
    if (finder := _finder()) is not None:
        return f"simulator: compiled modules (mypyc build {finder.folder.name})"
    if fresh_build() is not None:
        return "simulator: Python modules (--no-native, or run in-process)"
    return ("simulator: Python modules (no compiled build matches these sources; `make sim-native` builds one, "
            "~3x faster)")


def restart_compiled(argv: list[str]) -> None:
    """Start `skyline <argv>` again in this process with the compiled modules, when a build matches
    the sources (returns when none does, or they are active already)."""
    from skyline.core import envs

    if active() or envs.SIM_NATIVE.is_set():
        return
    folder = fresh_build()
    if folder is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "skyline.cli", *argv],
              {**os.environ, envs.SIM_NATIVE.name: str(folder)})


if __name__ == "__main__":  # `python -m skyline.tools.simulate.native`: what `make sim-native` runs
    print(build())
