"""Write docs/api.md from the code: every public name of phalanx.run, phalanx.torch, phalanx.spark (and its
estimator modules), phalanx.tensorflow.keras and phalanx.lightning, with its signature (arguments and defaults)
and its docstring. An object exported by several modules is described once and referred to after.

    .venv/bin/python tools/gen_api.py            # rewrite docs/api.md
    .venv/bin/python tools/gen_api.py --check    # exit 1 if docs/api.md is out of date
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import _gen

DOC = _gen.REPO / "docs" / "api.md"
MODULES = ("phalanx", "phalanx.torch", "phalanx.spark", "phalanx.spark.torch", "phalanx.spark.lightning",
           "phalanx.spark.keras", "phalanx.tensorflow.keras", "phalanx.lightning")
HEADER = """# API reference

Generated from the docstrings by `tools/gen_api.py` (`--check` fails when this file is out of date); do not
edit by hand. Narrative documentation: [torch.md](torch.md) (semantics of the Horovod API),
[tensorflow.md](tensorflow.md) (Keras),
[spark.md](spark.md) (Spark launchers), [estimators.md](estimators.md) (Spark estimators),
[env.md](env.md) (environment variables), [timeline.md](timeline.md),
[migration.md](migration.md) (also for the Lightning strategy).
"""


def public_names(module_name: str) -> list[str]:
    """The module's ``__all__`` (for ``phalanx``, only ``run``)."""
    module = importlib.import_module(module_name)
    return [n for n in module.__all__ if not n.startswith("__")]


def _default(value: Any) -> str:
    # The global process set's repr shows its current ranks (filled in by hvd.init): name it instead.
    from phalanx.torch import global_process_set

    return "global_process_set" if value is global_process_set else repr(value)


def _param(p: inspect.Parameter) -> str:
    text = p.name
    if p.annotation is not inspect.Parameter.empty:
        text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
    if p.default is not inspect.Parameter.empty:
        default = p.default.__name__ if inspect.isclass(p.default) else _default(p.default)
        text += f" = {default}" if p.annotation is not inspect.Parameter.empty else f"={default}"
    stars = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
    return stars + text


def signature(obj: Any) -> str:
    """``(a: int, b: str = 'x', *, c: bool = True) -> R``, annotations as written in the source."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts: list[str] = []
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in parts):
            parts.append("*")
        parts.append(_param(p))
    ret = sig.return_annotation
    arrow = "" if ret is inspect.Signature.empty or inspect.isclass(obj) else f" -> {ret}"
    return f"({', '.join(parts)}){arrow}"


def doc(obj: Any) -> str:
    text = inspect.getdoc(obj) or "(no docstring)"
    return "\n".join(("    " + line).rstrip() for line in text.splitlines())


def describe(qualified: str, obj: Any) -> list[str]:
    """Markdown for one public object: a heading, the signature and the docstring (class: its methods)."""
    if inspect.isclass(obj):
        lines = [f"### `{qualified}`", "", f"```python\nclass {qualified.rsplit('.', 1)[1]}{signature(obj)}\n```",
                 "", doc(obj), ""]
        for name, member in inspect.getmembers(obj, inspect.isfunction):
            if not name.startswith("_") and member.__qualname__.startswith(obj.__name__ + "."):
                lines += [f"#### `{qualified}.{name}`", "", f"```python\n{name}{signature(member)}\n```", "",
                          doc(member), ""]
        return lines
    if callable(obj):
        return [f"### `{qualified}`", "", f"```python\n{qualified}{signature(obj)}\n```", "", doc(obj), ""]
    if inspect.ismodule(obj):
        summary = (inspect.getdoc(obj) or "").split("\n\n")[0]
        return [f"### `{qualified}`", "", f"A submodule: {summary}", ""]
    return [f"### `{qualified}`", "", f"A constant: `{_default(obj)}` ({type(obj).__name__}).", ""]


def render() -> str:
    lines = [HEADER]
    described: dict[int, str] = {}  # id of a class or function -> where it was described first
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", (inspect.getdoc(module) or "").split("\n\n")[0], ""]
        for name in public_names(module_name):
            obj, qualified = getattr(module, name), f"{module_name}.{name}"
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) in described:
                lines += [f"### `{qualified}`", "", f"The same object as `{described[id(obj)]}`.", ""]
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                described[id(obj)] = qualified
            lines += describe(qualified, obj)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Rewrite docs/api.md, or with ``--check`` exit 1 when it differs from :func:`render`."""
    return _gen.main(__file__, DOC, render, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
