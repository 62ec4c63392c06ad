"""Helpers for running the examples: the ``examples/`` directory on ``sys.path`` (as when a user runs a
script from it), and each example's module loaded by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VENV_BIN = Path(sys.executable).parent


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as the module ``name`` (the examples import each other by name)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
