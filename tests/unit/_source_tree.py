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


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``: imports there are for the type checker
    and never run, so they make no import cycle."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(child for child in ast.iter_child_nodes(node) if not _type_checking(child))
    return nodes
