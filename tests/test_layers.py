"""The import contract: the layers of skyline/__init__.py hold, and every environment variable
is registered in skyline/core/envs.py.

Imports are read from the source (every `import`, also inside functions and TYPE_CHECKING
blocks), so a lazy import cannot slip past. A rule broken here names the importing file and
the import; where an import against the layers is right, the exception belongs in ALLOWED
with its reason.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from skyline.core.envs import ENVS

ROOT = Path(__file__).resolve().parent.parent
# Where each package's source lives (pyproject.toml's package-dir).
SOURCES = {"skyline": ROOT / "skyline", "skyline.gateway": ROOT / "gateway",
           "skyline.scheduler": ROOT / "scheduler", "skyline.workers": ROOT / "workers"}

# Layer of each top-level part, lowest first: a module may import its own part and lower
# layers, never a higher one, and processes (layer 2) never import each other.
LAYERS = {"skyline.scheduler": 0, "skyline.core": 1, "skyline.gateway": 2, "skyline.workers": 2,
          "skyline.batch": 2, "skyline.tools": 3, "skyline.cli": 4, "skyline": 4}

ALLOWED = {
    # The gateway serves the OpenAI Batch API over the batch package's data: its input format,
    # its objects and their Redis store (and RQ enqueue). The runner's own code stays out.
    ("skyline.gateway", "skyline.batch.jsonl"), ("skyline.gateway", "skyline.batch.objects"),
    ("skyline.gateway", "skyline.batch.store"), ("skyline.gateway", "skyline.batch.jobs"),
}

# Within the tools: the simulator runs the policy code, never the gateway's I/O stack.
FORBIDDEN_WITHIN = {("skyline.tools.simulate", "skyline.gateway")}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if pkg == "skyline" and parts and parts[0] in ("gateway", "scheduler", "workers"):
                continue  # not there: those live in their own folders
            out[".".join([pkg, *parts])] = path
    return out


def _imports(path: Path, module: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.rsplit(".", node.level)[0]
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            submodules = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in modules]
            found += [(node.lineno, n) for n in submodules or [name]]  # `from pkg import module`: the module
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "skyline"
    return ".".join(parts[:2])


def _tool(module: str) -> str:
    return ".".join(module.split(".")[:3])


def _violations() -> list[str]:
    modules = _modules()
    bad = []
    for mod, path in sorted(modules.items()):
        here = _part(mod)
        for line, name in _imports(path, mod, modules):
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if here == "skyline.scheduler" and not name.startswith("skyline.scheduler"):
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "__future__":
                    bad.append(f"{where}: scheduler/ is pure policy, stdlib only")
                    continue
            if not name.startswith("skyline.") or name not in modules:
                continue
            there = _part(name)
            if there == here or any(here == a and name == b for a, b in ALLOWED):
                continue
            forbidden = [(a, b) for a, b in FORBIDDEN_WITHIN if _tool(mod).startswith(a) and name.startswith(b)]
            if forbidden:
                bad.append(f"{where}: {forbidden[0][0]} must not import {forbidden[0][1]}")
            elif LAYERS[there] > LAYERS[here]:
                bad.append(f"{where}: layer {here} ({LAYERS[here]}) imports the higher {there} ({LAYERS[there]})")
            elif LAYERS[there] == LAYERS[here] == 2:
                bad.append(f"{where}: processes do not import each other ({here} -> {there})")
    return bad


def test_every_module_belongs_to_a_layer():
    unknown = sorted(m for m in _modules() if _part(m) not in LAYERS)
    assert not unknown, f"modules outside the layers of skyline/__init__.py: {unknown}"


def test_imports_follow_the_layers():
    bad = _violations()
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_contract_catches_imports_against_the_layers(tmp_path, monkeypatch):
    # The check itself: a core module that imports a tool, and the simulator importing the gateway.
    core = tmp_path / "skyline"
    (core / "core").mkdir(parents=True)
    (core / "tools").mkdir()
    (core / "core" / "bad.py").write_text("def f():\n    from skyline.tools.status import main\n")
    (core / "tools" / "status.py").write_text("def main(): pass\n")
    (core / "tools" / "simulate").mkdir()
    (core / "tools" / "simulate" / "fleet.py").write_text("from skyline.gateway import app\n")
    (tmp_path / "gw").mkdir()
    (tmp_path / "gw" / "app.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setitem(SOURCES, "skyline", core)
    monkeypatch.setitem(SOURCES, "skyline.gateway", tmp_path / "gw")
    for pkg in ("skyline.scheduler", "skyline.workers"):
        monkeypatch.setitem(SOURCES, pkg, tmp_path / "empty")
    bad = sorted(_violations())
    assert len(bad) == 2, bad
    assert "skyline/core/bad.py:2 imports skyline.tools.status: layer skyline.core (1) imports the higher" in bad[0]
    assert "skyline/tools/simulate/fleet.py:1 imports skyline.gateway.app: skyline.tools.simulate must not" in bad[1]


ENV_NAME = re.compile(r"\bSKYLINE_[A-Z0-9_]*[A-Z0-9]\b")
DIRECT_READ = re.compile(r"""os\.(environ\.get\(|environ\[|getenv\()\s*["']SKYLINE_""")


def _tracked_text_files() -> list[Path]:
    names = subprocess.check_output(["git", "ls-files"], cwd=ROOT, text=True).split()
    keep = re.compile(r"\.(py|md|toml|yaml|yml|sh|txt|html)$|(^|/)Makefile$|^\.ci/run$")
    return [ROOT / n for n in names if keep.search(n) and not n.startswith("benchmarks/") and (ROOT / n).is_file()]


def test_every_environment_variable_is_registered_and_read_through_the_registry():
    unregistered, direct = [], []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        for name in set(ENV_NAME.findall(text)):
            if name not in ENVS:
                unregistered.append(f"{path.relative_to(ROOT)}: {name}")
        if path.suffix == ".py" and path.name != "envs.py":
            for i, line in enumerate(text.splitlines(), 1):
                if DIRECT_READ.search(line):
                    direct.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not unregistered, "SKYLINE_* names missing from skyline/core/envs.py:\n" + "\n".join(unregistered)
    assert not direct, "read these through skyline.core.envs:\n" + "\n".join(direct)


def _expand(pattern: str) -> list[str]:
    """`a/{b,c}.py` -> [a/b.py, a/c.py]."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _source_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in _modules().values() if p.name != "__init__.py"}


def test_the_module_map_names_every_module_and_nothing_else():
    doc = (ROOT / "docs" / "modules.md").read_text()
    named = {x for cell in re.findall(r"`([\w/{},.]+\.py)`", doc) for x in _expand(cell) if "/" in x}
    # A row may name two modules of one folder as `a/b.py`, `c.py`.
    for row in re.findall(r"^\| `([\w/]+/)[\w]+\.py`, `([\w]+\.py)`", doc, re.M):
        named.add(row[0] + row[1])
    missing, stale = _source_files() - named, {n for n in named if not (ROOT / n).exists()}
    assert not missing, f"modules missing from docs/modules.md: {sorted(missing)}"
    assert not stale, f"docs/modules.md names modules that do not exist: {sorted(stale)}"


def test_the_readme_module_map_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Module map"):readme.index("## Tests")]
    named = set()
    for cell in re.findall(r"`([\w/{},.]+)`", section):
        for path in _expand(cell):
            if path.endswith(".py") or path.endswith("/"):
                assert (ROOT / path).exists(), f"README's module map names {path}, which does not exist"
                named.add(path)
    covered = {f for f in _source_files() if f in named or any(f.startswith(d) for d in named if d.endswith("/"))}
    assert covered == _source_files(), f"modules the README's map leaves out: {sorted(_source_files() - covered)}"
