"""The package's parsed source, read once per test process (the source-scanning tests share it)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


@functools.cache
def parsed() -> tuple[tuple[Path, ast.Module], ...]:
    """Every ``.py`` file under ``src/`` with its syntax tree, in path order."""
    return tuple((p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(SRC.rglob("*.py")))
