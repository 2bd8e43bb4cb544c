"""The simulator compiled with mypyc (skyline/tools/simulate/native.py) gives every result the Python
modules give, and a build is used only for the sources it was compiled from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skyline.tools.simulate import native

# Fleets that take every path of the event loop: both modes, tight targets (admission refuses), a shared
# host; a CPU fleet past its prefill capacity (preemption, requeues); multi-turn sessions with prefix
# caches, with and without affinity; elastic workers beside fixed pools (hand-offs, both stages claimed).
PROFILE = str(Path(__file__).parents[1] / "skyline/tools/simulate/profiles/cpu-2core-2026-12-01.json")
RUNS = {
    "overloaded-cpu": ["--profile", PROFILE, "--mode", "both", "--prefill", "1", "--decode", "2", "--rates", "3,6",
                       "--duration", "20", "--no-admission"],
    "mixed": ["--gpu", "H100", "--model", "llama-3-8b", "--mode", "both", "--prefill", "2", "--decode", "6",
              "--rates", "30,60", "--duration", "20", "--lengths", "sharegpt", "--mix", "0.5",
              "--slo-ttft-ms", "chat=150,rag=600", "--slo-tpot-ms", "40", "--shared-host", "1.2", "--drain", "10"],
    "elastic": ["--gpu", "H100", "--model", "llama-3-8b", "--mode", "disagg", "--prefill", "1", "--decode", "3",
                "--elastic-workers", "4", "--rates", "30,60", "--duration", "20", "--lengths", "sharegpt", "--mix",
                "0.5", "--slo-ttft-ms", "chat=150,rag=600", "--slo-tpot-ms", "40", "--drain", "10"],
    "multiturn": ["--gpu", "H100", "--model", "llama-3-8b", "--mode", "colocated", "--colocated-workers", "8",
                  "--workload", "multiturn", "--rates", "4", "--duration", "20", "--affinity", "both",
                  "--slo-ttft-ms", "chat=200,rag=800", "--slo-tpot-ms", "40"],
}
TIMINGS = {"wall_s", "summarize_s", "generate_s", "started", "finished", "generated_at", "started_at",
           "load_average", "out", "command", "argv"}


def _scrub(o):
    if isinstance(o, dict):
        return {k: _scrub(v) for k, v in o.items() if k not in TIMINGS}
    if isinstance(o, list):
        return [_scrub(x) for x in o]
    return o


def _simulate(args: list[str], out: Path) -> tuple[str, dict]:
    proc = subprocess.run([sys.executable, "-m", "skyline.cli", "simulate", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, _scrub(json.loads((out / "results.json").read_text()))


@pytest.fixture(scope="module")
def build() -> Path:
    """The build of the sources as they are (made here when `make sim-native` has not: ~1 min)."""
    return native.fresh_build() or native.build()


@pytest.mark.parametrize("run", sorted(RUNS))
def test_the_compiled_simulator_gives_every_result_the_python_one_gives(build, run, tmp_path):
    compiled_out, compiled = _simulate(RUNS[run], tmp_path / "compiled")
    python_out, python = _simulate([*RUNS[run], "--no-native"], tmp_path / "python")
    assert f"simulator: compiled modules (mypyc build {build.name})" in compiled_out, compiled_out[:2000]
    assert "simulator: Python modules" in python_out
    assert compiled == python
    if run == "overloaded-cpu":  # the run took the preemption path
        assert sum(r["summary"]["sim"]["counters"]["preempted"] for r in compiled["runs"]) > 0


def test_a_build_serves_only_the_sources_it_was_compiled_from(build, monkeypatch, tmp_path):
    assert native.fresh_build() == build
    edited = tmp_path / "tiers.py"
    origin = native._origin
    edited.write_bytes(origin("skyline.scheduler.tiers").read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(native, "_origin", lambda m: edited if m == "skyline.scheduler.tiers" else origin(m))
    assert native.fresh_build() is None
    assert "no compiled build matches these sources" in native.describe()
