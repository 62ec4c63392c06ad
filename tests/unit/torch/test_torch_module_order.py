"""The modules of ``phalanx.torch`` import each other one way: no cycle, function-level imports included (those
under ``if TYPE_CHECKING:`` never run and are left out)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit._source_tree import run_time_nodes

import phalanx.torch

PKG = Path(phalanx.torch.__file__).parent


def _name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = ["phalanx", "torch", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The phalanx.torch modules ``path`` imports when it runs, at any level of its code."""
    found: set[str] = set()
    for node in run_time_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_name(p): p for p in PKG.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle_among_the_engine_modules() -> None:
    graph = _graph()
    # a package's __init__ re-exports its submodules: an edge into it from below is not a cycle of code
    inits = {"phalanx.torch", "phalanx.torch.shm", "phalanx.torch.elastic"}
    code = {k: {v for v in vs if v not in inits} for k, vs in graph.items() if k not in inits}
    assert _cycle(code) is None, " -> ".join(_cycle(code) or [])
