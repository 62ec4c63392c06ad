"""Serialize the user's function and arguments on the driver, before any process starts.

cloudpickle carries functions defined in ``__main__`` or a notebook cell by value. When something cannot
be pickled, :func:`find_unpicklable` walks the function's closure, referenced globals, defaults and the
arguments to name the object at fault (``fn closure variable 'lock' (a _thread.lock)``), because
pickle's own message never says where the object sits.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle

from phalanx.errors import PayloadError

_MAX_DEPTH = 6


@dataclass(frozen=True)
class Call:
    """A function call to run on every rank."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def driver_sys_path() -> tuple[str, ...]:
    """The driver's import path, so that workers find the modules the driver's functions live in."""
    return tuple(p for p in sys.path if isinstance(p, str))


_DYNAMIC_FILENAME = "<dynamic-code>"


def _code_reduce_keeping_filename(code: types.CodeType) -> tuple[Any, ...]:
    """cloudpickle's reduction of a code object, with its real ``co_filename`` back in place of
    ``<dynamic-code>``: a function pickled by value (``__main__``, a notebook cell) then fails on a rank
    with its file and line in the traceback, as it would have on the driver."""
    reduced = cloudpickle.cloudpickle._code_reduce(code)
    args = tuple(code.co_filename if arg == _DYNAMIC_FILENAME else arg for arg in reduced[1])
    return (reduced[0], args, *reduced[2:])


class _Pickler(cloudpickle.Pickler):
    _dispatch_table = {**cloudpickle.Pickler._dispatch_table, types.CodeType: _code_reduce_keeping_filename}
    dispatch_table = ChainMap(_dispatch_table, copyreg.dispatch_table)


def dumps(obj: Any) -> bytes:
    """cloudpickle ``obj`` at the highest protocol (code objects keep their file name)."""
    with io.BytesIO() as file:
        _Pickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return file.getvalue()


def serialize_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   sys_path: tuple[str, ...] | None = None) -> bytes:
    """Serialize a call, naming the offending object when that fails.

    Functions from importable modules travel by reference: the worker imports their module. The payload
    therefore also carries an import path (default: the driver's ``sys.path``) that the worker appends
    to its own before loading the call.

    Raises:
        PayloadError: something in ``fn``, ``args`` or ``kwargs`` cannot be pickled.
    """
    if not callable(fn):
        raise PayloadError(f"fn must be callable; got {fn!r} of type {type(fn).__name__}")
    try:
        body = dumps(Call(fn=fn, args=tuple(args), kwargs=dict(kwargs)))
    except Exception as e:
        roots = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
        roots += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        where = next((found for path, obj in roots if (found := find_unpicklable(obj, path))), None)
        culprit = where or "the call"
        raise PayloadError(
            f"cannot send {culprit} to the workers: {type(e).__name__}: {e}. Everything the function "
            "uses travels by cloudpickle: create such objects (locks, open files, sockets, Spark "
            "contexts) inside the function instead of capturing them."
        ) from e
    path = driver_sys_path() if sys_path is None else sys_path
    return pickle.dumps((path, body), protocol=pickle.HIGHEST_PROTOCOL)


def load_call(data: bytes) -> Call:
    """Inverse of :func:`serialize_call` (run on the worker): extend ``sys.path``, then load the call."""
    path, body = pickle.loads(data)
    sys.path.extend(p for p in path if p not in sys.path)
    call = cloudpickle.loads(body)
    if not isinstance(call, Call):
        raise PayloadError(f"payload holds a {type(call).__name__}, not a phalanx Call")
    return call


def _picklable(obj: Any) -> bool:
    try:
        dumps(obj)
    except Exception:
        return False
    return True


def _function_parts(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:
            continue
    for name in code.co_names:
        if name in fn.__globals__:
            yield f"global {name!r}", fn.__globals__[name]
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f"default #{i}", default
    for key, value in (fn.__kwdefaults__ or {}).items():
        yield f"default {key!r}", value


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, types.FunctionType):
        yield from _function_parts(obj)
    elif isinstance(obj, types.MethodType):
        yield "__self__", obj.__self__
        yield "__func__", obj.__func__
    elif isinstance(obj, dict):
        yield from ((f"[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, list | tuple | set | frozenset):
        yield from ((f"[{i}]", v) for i, v in enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, type | types.ModuleType):
        yield from ((f".{k}", v) for k, v in vars(obj).items())


def find_unpicklable(obj: Any, path: str, depth: int = 0) -> str | None:
    """Return a description of the innermost unpicklable object inside ``obj``, or None if it pickles.

    Args:
        obj: the object to check.
        path: how the user would name ``obj`` (``fn``, ``args[0]``).
        depth: recursion depth (the walk stops at a fixed depth and blames the object reached).
    """
    if _picklable(obj):
        return None
    if depth < _MAX_DEPTH:
        for label, part in _parts(obj):
            sep = " " if label[0] not in "[." else ""
            found = find_unpicklable(part, f"{path}{sep}{label}", depth + 1)
            if found:
                return found
    kind = type(obj)
    return f"{path} (a {kind.__module__}.{kind.__qualname__})"
