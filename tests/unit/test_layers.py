"""The layering rule of docs/design.md: imports flow one way, heavy dependencies stay out of light layers.

An import is an ``import`` statement, or a phalanx module named in a string (``importlib.import_module``,
the warm-start template's preload list, the start-up hooks' targets); a module name that follows ``"-m"``
starts another process and is not an import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _source_tree import run_time_nodes

import phalanx

PKG = Path(phalanx.__file__).parent
#: The interpreter start-up hooks the .pth files call: a top-level package (start-up must not import phalanx).
STARTUP = PKG.parent / "_phalanx_startup"

# layer -> the phalanx layers it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "env": {"errors"},
    "job": {"errors", "env"},
    "observe": {"job", "env", "errors"},
    "launch": {"observe", "job", "env", "errors"},
    "worker": {"transport", "compat", "job", "env", "errors"},  # transport, compat: by name, at run time
    "timeline": {"env", "errors"},
    "transport": {"env", "errors"},
    "torch": {"transport", "job", "env", "timeline", "errors"},
    "tensorflow": {"torch", "env", "timeline", "errors"},
    "lightning": {"torch", "env", "errors"},
    "spark": {"launch", "observe", "job", "env", "errors", "worker"},
    "estimator": {"spark", "torch", "tensorflow", "lightning", "launch", "job", "env", "errors", "worker"},
    "cli": {"launch", "observe", "env", "errors", "timeline", "job", "__init__"},
    "compat": {"torch", "tensorflow", "spark", "estimator", "launch", "lightning", "cli", "env", "errors",
               "__init__"},
    "__init__": {"launch"},
    "__main__": {"cli"},
    "_phalanx_startup": {"compat", "worker", "lightning"},
}

# layer -> the only modules of it that other layers may import (its interface); a layer not named here
# exposes every module
INTERFACE: dict[str, set[str]] = {
    "transport": {"phalanx.transport.api", "phalanx.transport.backend", "phalanx.transport.native"},
    # Horovod's public modules, and frontend.py: what the other front ends (tensorflow/) build on
    "torch": {"phalanx.torch", "phalanx.torch.frontend", "phalanx.torch.basics", "phalanx.torch.process_sets",
              "phalanx.torch.elastic", "phalanx.torch.elastic.state"},
}


# Sub-layers: paths inside a layer's package that form a layer of their own (the estimators sit in
# phalanx.spark for Horovod's names, but train with phalanx.torch / phalanx.tensorflow, which spark/ may not).
SUBLAYERS = {"spark/estimator": "estimator", "spark/torch.py": "estimator", "spark/keras.py": "estimator",
             "spark/lightning.py": "estimator", "spark/common": "estimator"}
SUBLAYER_MODULES = {"spark.estimator": "estimator", "spark.torch": "estimator", "spark.keras": "estimator",
                    "spark.lightning": "estimator", "spark.common": "estimator"}


def _layer(path: Path) -> str:
    if path.is_relative_to(STARTUP):
        return STARTUP.name
    rel = path.relative_to(PKG)
    for prefix, layer in SUBLAYERS.items():
        if rel.as_posix() == prefix or rel.as_posix().startswith(prefix + "/"):
            return layer
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def _phalanx_imports(path: Path) -> set[str]:
    return {_layer_of(name) for name in _phalanx_modules(path)}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return SUBLAYER_MODULES.get(".".join(parts[1:3]), parts[1] if len(parts) > 1 else "__init__")


def _phalanx_modules(path: Path, *, by_name: bool = True) -> set[str]:
    """The phalanx modules ``path`` imports (``from phalanx.x import y``: ``phalanx.x.y`` when that is a
    module, else ``phalanx.x``); with ``by_name``, also the modules it names in strings; without it, only
    the imports that run (not those under ``if TYPE_CHECKING:``)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    started = _process_entry_points(tree)
    for node in ast.walk(tree) if by_name else run_time_nodes(tree):
        names = []
        if by_name and isinstance(node, ast.Constant) and isinstance(node.value, str) and node not in started:
            names = [node.value] if _is_module(node.value) else []
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [_submodule(node.module, a.name) for a in node.names]
        found.update(name for name in names if name.split(".")[0] == "phalanx")
    return found


def _process_entry_points(tree: ast.AST) -> set[ast.AST]:
    """The string constants that follow ``"-m"`` in a list or tuple (``[python, "-m", "phalanx.worker"]``)."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for before, after in zip(node.elts, node.elts[1:]):
                if isinstance(before, ast.Constant) and before.value == "-m":
                    found.add(after)
    return found


def _is_module(name: str) -> bool:
    """Whether ``name`` is a phalanx module (``phalanx.x.y``, a file or a package of the tree)."""
    parts = name.split(".")
    if parts[0] != "phalanx" or len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return False
    rel = Path(*parts[1:])
    return (PKG / rel).is_dir() or (PKG / rel).with_suffix(".py").is_file()


def _submodule(module: str, name: str) -> str:
    """``module.name`` when that is a module of phalanx, else ``module``."""
    return f"{module}.{name}" if _is_module(f"{module}.{name}") else module


def _modules() -> list[Path]:
    return sorted(p for p in [*PKG.rglob("*.py"), *STARTUP.rglob("*.py")] if _layer(p) in ALLOWED)


def _rel(path: Path) -> Path:
    return path.relative_to(PKG.parent)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(_rel(p)))
def test_imports_flow_one_way(path: Path) -> None:
    layer = _layer(path)
    bad = _phalanx_imports(path) - ALLOWED[layer] - {layer}
    assert not bad, f"{_rel(path)} (layer {layer}) imports {sorted(bad)}; allowed: {sorted(ALLOWED[layer])}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(_rel(p)))
def test_other_layers_use_only_a_layers_interface(path: Path) -> None:
    layer = _layer(path)
    outside = {m for m in _phalanx_modules(path) if _layer_of(m) != layer and _layer_of(m) in INTERFACE}
    bad = sorted(m for m in outside if m not in INTERFACE[_layer_of(m)])
    assert not bad, f"{_rel(path)} imports {bad}, outside their layer's interface {INTERFACE}"


def _module_name(path: Path) -> str:
    parts = _rel(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v] & graph.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    """No two modules import each other, directly or through others, by an import statement anywhere in
    them (a function-local import too); modules named in strings are started or aliased, not imported."""
    graph = {_module_name(p): _phalanx_modules(p, by_name=False) for p in _modules()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_start_up_files_are_one_import_of_the_start_up_package() -> None:
    pths = sorted(PKG.parent.rglob("*.pth"))
    assert pths, "no .pth start-up files found"
    for pth in pths:
        assert pth.parent == STARTUP, f"{_rel(pth)}: start-up files live in {_rel(STARTUP)}"
        lines = pth.read_text().splitlines()
        tree = ast.parse(lines[0]) if len(lines) == 1 else None
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] if tree else []
        assert imported == [STARTUP.name], f"{_rel(pth)} must be one line importing {STARTUP.name}: {lines}"


def _design_table() -> dict[str, set[str]]:
    """docs/design.md's layer table: layer -> what it may import (last column)."""
    text = (PKG.parent.parent / "docs" / "design.md").read_text()
    table: dict[str, set[str]] = {}
    for path, rights in re.findall(r"^\| `([\w./]+)`[^|]*\|.*\| ([^|]*) \|$", text, re.M):
        layer = path.rstrip("/").split("/")[-1].removesuffix(".py")
        names = re.sub(r"\([^)]*\)|by name at run time:|`", "", rights).replace(";", ",").split(",")
        table[layer] = {"__init__" if n.strip() == "phalanx" else n.strip() for n in names} - {"", "—"}
    return table


def test_design_md_draws_the_same_table() -> None:
    assert _design_table() == ALLOWED


def test_every_module_belongs_to_a_layer() -> None:
    unknown = sorted({_layer(p) for p in PKG.rglob("*.py")} - set(ALLOWED))
    assert not unknown, f"modules outside the layer table: {unknown}; add them to docs/design.md and ALLOWED"


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("phalanx", ["torch", "pyspark", "cloudpickle"]),
        ("phalanx.env", ["torch", "pyspark"]),
        ("phalanx.errors", ["torch", "pyspark"]),
        ("phalanx.launch.api", ["torch", "pyspark"]),
        ("phalanx.worker.exec", ["torch", "pyspark", "cloudpickle"]),
        ("phalanx.cli.main", ["torch", "pyspark"]),
        ("phalanx.torch", ["pyspark", "tensorflow", "keras"]),
        ("phalanx.transport.backend", ["phalanx.torch", "pyspark", "tensorflow", "keras"]),
        ("phalanx.compat", ["tensorflow", "keras", "torch"]),
        ("phalanx.lightning", ["torch", "lightning", "pytorch_lightning", "pyspark"]),
        ("phalanx.timeline", ["torch", "pyspark"]),
        ("phalanx.observe", ["torch", "pyspark", "prometheus_client", "mlflow"]),
        ("phalanx.spark", ["pyspark", "torch", "tensorflow", "keras"]),
    ],
)
def test_importing_does_not_pull_heavy_dependencies(module: str, forbidden: list[str]) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import {module} also imported: {out.stdout.strip()}"
