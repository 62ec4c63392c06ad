"""Every exception phalanx raises comes from phalanx/errors.py: no bare ValueError / RuntimeError / TypeError
(the typed errors subclass them, so callers' ``except ValueError`` keeps working). No processes."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

from _source_tree import SRC, parsed

from phalanx import errors

BARE = frozenset({"ValueError", "RuntimeError", "TypeError"})


def _bare_raises(path: Path, tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name) and target.id in BARE:
            found.append(f"{path.relative_to(SRC)}:{node.lineno} raises {target.id}")
    return found


def test_no_bare_builtin_raise_in_the_package() -> None:
    found = [hit for path, tree in parsed() for hit in _bare_raises(path, tree)]
    assert not found, f"raise a typed error from phalanx/errors.py instead: {found}"


def test_the_typed_errors_keep_the_builtin_a_caller_catches_and_pickle() -> None:
    expected = {errors.InvalidArgumentError: ValueError, errors.SettingError: ValueError,
                errors.UsageError: RuntimeError, errors.CollectiveMismatchError: RuntimeError,
                errors.ShmTransportError: RuntimeError}
    for cls, builtin in expected.items():
        error = cls("what happened; the fix")
        assert isinstance(error, builtin) and isinstance(error, errors.PhalanxError)
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and back.args == error.args
