"""The package layering of docs/architecture.md, checked on the source: no upward import, no import cycle.

Every import statement counts, including those inside functions: a function-level import delays a heavy module, it
does not make an upward dependency acceptable.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "scaletrain"

# Lowest first; a module may import its own package or a lower layer (docs/architecture.md, "Layers").
# Layer 0 has an order inside it: the logger, the benchmark registry and the TOML machinery come before config.
LAYERS: dict[str, float] = {
    "log": 0,
    "diskfull": 0,
    "benchmarks": 0,
    "architectures": 0,
    "config_io": 0,
    "config_bounds": 0.1,
    "config_model": 0.25,
    "config": 0.5,
    "presets": 0.5,
    "sim": 1,
    "sim.fit": 1.5,
    "data": 2,
    "model": 2,
    "parallel": 3,
    "checkpoint": 4,
    "train": 5,
    "bench": 6,
    "cli": 7,
    "__main__": 8,
}
# Same-layer pairs that are allowed in one direction only (data uses the loss's ignore index; model knows no data).
SIDEWAYS = {("data", "model")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported scaletrain module, line) for every import statement in the file."""
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from scaletrain import sim` imports the submodule sim.
            found += [
                (f"{target}.{a.name}", node.lineno)
                for a in node.names
                if (SRC.parent / target.replace(".", "/") / a.name).exists()
                or (SRC.parent / target.replace(".", "/") / f"{a.name}.py").exists()
            ]
    return [(t, line) for t, line in found if t == "scaletrain" or t.startswith("scaletrain.")]


def _package(module: str) -> str:
    """The LAYERS key of a module: its top-level package, or a subpackage with a layer of its own (sim.fit)."""
    parts = module.split(".")
    if len(parts) > 2 and f"{parts[1]}.{parts[2]}" in LAYERS:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def test_every_package_has_a_layer():
    packages = {_package(_module_name(p)) for p in _sources()} - {"__init__"}
    assert packages <= set(LAYERS), f"packages without a layer in docs/architecture.md: {packages - set(LAYERS)}"


def test_no_module_imports_upward():
    upward = []
    for path in _sources():
        me = _package(_module_name(path))
        if me == "__init__":
            continue
        for target, line in _imports(path):
            other = _package(target)
            if other in ("__init__", me):
                continue
            mine, theirs = LAYERS[me], LAYERS[other]
            if theirs > mine or (theirs == mine and (me, other) not in SIDEWAYS):
                upward.append(f"{path.relative_to(SRC.parent)}:{line} ({me}, layer {mine}) imports {target} ({theirs})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _sources()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, _ in _imports(path):
            # `from pkg import name` names a module only when pkg.name is one; otherwise the edge is to pkg.
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module and target in modules and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def test_no_import_cycles():
    graph = _graph()
    # A package __init__ that re-exports its own modules is the package's face, not a dependency: skip edges into
    # a package from its own submodules' importers only when they are the package itself.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_upward_import_is_caught(tmp_path, monkeypatch):
    # The check itself must be able to fail: a planted function-level import of bench/ from train/.
    fake = tmp_path / "scaletrain"
    (fake / "train").mkdir(parents=True)
    (fake / "bench").mkdir()
    for pkg in ("", "train", "bench"):
        (fake / pkg / "__init__.py").write_text('"""x"""\n')
    (fake / "train" / "loop.py").write_text("def f():\n    from scaletrain.bench import harness\n")
    (fake / "bench" / "harness.py").write_text("import scaletrain.train.loop\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    with pytest.raises(AssertionError, match="train/loop.py:2"):
        test_no_module_imports_upward()
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()


def test_sim_and_config_import_no_torch():
    # sim/ prices clusters on machines without torch (and sim.fit fits it there); config and the registries are
    # read by it.
    modules = [
        _module_name(p)
        for p in _sources()
        if _package(_module_name(p)) in ("sim", "sim.fit", "config", "log", "benchmarks")
    ]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing {modules} pulled in torch"
