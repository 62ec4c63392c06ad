"""The share of function signatures that use ``typing.Any``, per package under src/phalanx.

    .venv/bin/python tools/any_share.py                      # every package
    .venv/bin/python tools/any_share.py tensorflow spark     # those packages (subpackages included)
    .venv/bin/python tools/any_share.py --list spark         # and each signature that uses Any

A signature is one ``def`` (methods, nested functions and overloads included); it uses Any when a parameter's
annotation (``*args`` and ``**kwargs`` included) or the return annotation names ``Any``, at any depth
(``dict[str, Any]`` counts), written bare, as ``typing.Any`` or inside a string annotation. A signature with
no annotation at all counts as one without Any (mypy's ``disallow_untyped_defs`` leaves none in src/).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "phalanx"


@dataclass(frozen=True)
class Signature:
    """One ``def``: where it is and whether its annotations name Any."""

    path: Path
    line: int
    name: str
    uses_any: bool


def _names_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if _names_any(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
    return False


def _annotations(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.expr | None]:
    arguments = function.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
        yield argument.annotation
    for star in (arguments.vararg, arguments.kwarg):
        if star is not None:
            yield star.annotation
    yield function.returns


def signatures(path: Path) -> Iterator[Signature]:
    """Every ``def`` in the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            uses_any = any(_names_any(annotation) for annotation in _annotations(node))
            yield Signature(path, node.lineno, node.name, uses_any)


def package_signatures(package: str) -> list[Signature]:
    """Every ``def`` in src/phalanx/``package`` (a dotted or slashed subpackage name) and its subpackages."""
    root = PACKAGE / package.replace(".", "/")
    if not root.is_dir():
        raise SystemExit(f"any_share: no package {package!r} under {PACKAGE}")
    return [signature for path in sorted(root.rglob("*.py")) for signature in signatures(path)]


def share(found: Iterable[Signature]) -> tuple[int, int]:
    """(signatures that use Any, all signatures)."""
    listed = list(found)
    return sum(signature.uses_any for signature in listed), len(listed)


def _packages() -> list[str]:
    return sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("packages", nargs="*", help="packages under src/phalanx (default: every one)")
    parser.add_argument("--list", action="store_true", help="print each signature that uses Any")
    arguments = parser.parse_args(argv)
    for package in arguments.packages or _packages():
        found = package_signatures(package)
        with_any, total = share(found)
        percent = 100.0 * with_any / total if total else 0.0
        print(f"{package:<16} {with_any:>4} of {total:>4} signatures use Any ({percent:.0f}%)")
        if arguments.list:
            for signature in found:
                if signature.uses_any:
                    where = signature.path.relative_to(PACKAGE)
                    print(f"    {where}:{signature.line} {signature.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
