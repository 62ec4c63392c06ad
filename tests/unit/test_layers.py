"""The layering rule of docs/design.md: imports flow one way, heavy dependencies stay out of light layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx

PKG = Path(phalanx.__file__).parent

# layer -> the phalanx layers it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "env": {"errors"},
    "job": {"errors", "env"},
    "launch": {"job", "env", "errors"},
    "worker": {"job", "env", "errors"},
    "timeline": {"env", "errors"},
    "transport": {"env", "errors"},
    "torch": {"transport", "job", "env", "timeline", "errors"},
    "tensorflow": {"torch", "env", "timeline", "errors"},
    "lightning": {"torch", "env", "errors"},
    "spark": {"launch", "job", "env", "errors", "worker"},
    "estimator": {"spark", "torch", "tensorflow", "lightning", "launch", "job", "env", "errors", "worker"},
    "cli": {"launch", "env", "errors", "timeline", "job", "__init__"},
    "compat": {"torch", "tensorflow", "spark", "launch", "lightning", "env", "errors", "__init__"},
    "__init__": {"launch"},
}

# layer -> the only modules of it that other layers may import (its interface); a layer not named here
# exposes every module
INTERFACE: dict[str, set[str]] = {
    "transport": {"phalanx.transport.api", "phalanx.transport.backend"},
}


# Sub-layers: paths inside a layer's package that form a layer of their own (the estimators sit in
# phalanx.spark for Horovod's names, but train with phalanx.torch / phalanx.tensorflow, which spark/ may not).
SUBLAYERS = {"spark/estimator": "estimator", "spark/torch.py": "estimator", "spark/keras.py": "estimator",
             "spark/lightning.py": "estimator", "spark/common": "estimator"}
SUBLAYER_MODULES = {"spark.estimator": "estimator", "spark.torch": "estimator", "spark.keras": "estimator",
                    "spark.lightning": "estimator", "spark.common": "estimator"}


def _layer(path: Path) -> str:
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


def _phalanx_modules(path: Path) -> set[str]:
    """The phalanx modules ``path`` imports (``from phalanx.x import y``: ``phalanx.x.y`` when that is a
    module, else ``phalanx.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [_submodule(node.module, a.name) for a in node.names]
        found.update(name for name in names if name.split(".")[0] == "phalanx")
    return found


def _submodule(module: str, name: str) -> str:
    """``module.name`` when that is a module of phalanx, else ``module``."""
    rel = Path(*f"{module}.{name}".split(".")[1:])
    return f"{module}.{name}" if (PKG / rel).is_dir() or (PKG / rel).with_suffix(".py").is_file() else module


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if _layer(p) in ALLOWED)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_flow_one_way(path: Path) -> None:
    layer = _layer(path)
    bad = _phalanx_imports(path) - ALLOWED[layer] - {layer}
    assert not bad, f"{path.relative_to(PKG)} (layer {layer}) imports {sorted(bad)}; allowed: {sorted(ALLOWED[layer])}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_other_layers_use_only_a_layers_interface(path: Path) -> None:
    layer = _layer(path)
    outside = {m for m in _phalanx_modules(path) if _layer_of(m) != layer and _layer_of(m) in INTERFACE}
    bad = sorted(m for m in outside if m not in INTERFACE[_layer_of(m)])
    assert not bad, f"{path.relative_to(PKG)} imports {bad}, outside their layer's interface {INTERFACE}"


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
