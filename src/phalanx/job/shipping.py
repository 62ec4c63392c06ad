"""Ship the modules that sit next to the driver's script (or notebook) to the machines that run the ranks.

HorovodRunner documents that a function importing a module from the driver's directory fails when
``np > 1``: the executors do not have the file. phalanx sends the source of those modules with the
payload (``phalanx.spark``, and ``phalanx.run`` across hosts); on the worker they are written to a private
directory put first on ``sys.path`` *before* the user's call is unpickled, so both ``import helper`` inside
the function and references to ``helper``'s functions in its globals work. A hosts job running a script
ships the script's directory the same way (:func:`script_of`, :func:`write_modules`: the host agent writes
them and puts the directory on the ranks' ``PYTHONPATH``).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from phalanx.errors import InvalidArgumentError
from phalanx.job.payload import driver_sys_path, load_call, serialize_call

log = logging.getLogger(__name__)

#: Most files and bytes shipped; a directory over these limits is not shipped (with a warning).
MAX_FILES = 300
MAX_BYTES = 20 << 20


def driver_root() -> Path | None:
    """The directory of the driver's script, or the working directory in a notebook / REPL.

    Returns None when that directory belongs to the Python installation (``pytest``, ``python -m``),
    where nothing is the user's.
    """
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    root = Path(main_file).resolve().parent if main_file else Path.cwd().resolve()
    if any(_under(root, Path(p)) for p in _installation_dirs()):
        return None
    return root


def _installation_dirs() -> set[str]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    dirs.update(p for p in (sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib")) if p)
    return {str(Path(d).resolve()) for d in dirs}


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _imported_under(root: Path) -> set[Path]:
    """The resolved files of the imported modules that live under ``root`` (resolved itself).

    Each directory is resolved once (most modules share a few), then only a file that is itself a
    symbolic link is resolved on its own: ``realpath(dir/name)`` is ``realpath(dir)/name`` otherwise.
    """
    top = str(root)
    prefix = top if top.endswith(os.sep) else top + os.sep
    dirs: dict[str, str] = {}
    found: set[Path] = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py"):
            continue
        head, name = os.path.split(file)
        if head not in dirs:
            dirs[head] = os.path.realpath(head)
        path = os.path.join(dirs[head], name)
        if os.path.islink(path):
            path = os.path.realpath(path)
        if path == top or path.startswith(prefix):
            found.add(Path(path))
    return found


def _candidates(root: Path, imported: bool) -> set[Path]:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    found = {p.resolve() for p in root.glob("*.py")}
    if imported:
        found |= _imported_under(root)
    if main_file:
        found.discard(Path(main_file).resolve())
    return {p for p in found if "site-packages" not in p.parts and p.is_file()}


def collect_modules(root: Path | None, imported: bool = True) -> dict[str, bytes]:
    """The driver-local module files to ship: ``relative path -> source bytes``.

    Every ``*.py`` directly in ``root`` and, with ``imported``, every imported module under it (packages
    included), except the driver script itself. Over :data:`MAX_FILES` / :data:`MAX_BYTES` nothing is shipped.
    """
    if root is None:
        return {}
    files = sorted(_candidates(root, imported))
    total = sum(p.stat().st_size for p in files)
    if len(files) > MAX_FILES or total > MAX_BYTES:
        log.warning("phalanx: not shipping the %d module files (%d bytes) under %s to the executors: over "
                    "the limit of %d files / %d bytes; install them on the executors instead",
                    len(files), total, root, MAX_FILES, MAX_BYTES)
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def script_of(command: Sequence[str]) -> str | None:
    """The Python script a command runs (``python x.py ...`` or ``x.py ...``), or None."""
    if not command:
        return None
    exe = command[0]
    is_python = os.path.basename(exe).startswith("python")
    script = command[1] if is_python and len(command) > 1 else (exe if exe.endswith(".py") else None)
    return script if script and not script.startswith("-") and script.endswith(".py") else None


def write_modules(files: dict[str, bytes], directory: str) -> None:
    """Write shipped modules (relative path -> source) under ``directory``.

    Raises:
        InvalidArgumentError: a path that is absolute or leaves ``directory``.
    """
    root = Path(directory).resolve()
    for rel, data in files.items():
        target = (root / rel).resolve()
        if Path(rel).is_absolute() or not _under(target, root) or target == root:
            raise InvalidArgumentError(f"shipped module path {rel!r} leaves the modules' directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def run_with_modules(files: dict[str, bytes], inner: bytes) -> Any:
    """Worker side: write the shipped modules, put them first on ``sys.path``, then run the call.

    Args:
        files: relative path -> source, from :func:`collect_modules`.
        inner: the user's serialized call (loaded only once the modules can be imported).

    Returns:
        The user's function's return value.
    """
    directory = tempfile.mkdtemp(prefix="phalanx-modules-")
    try:
        write_modules(files, directory)
        sys.path.insert(0, directory)
        call = load_call(inner)
        return call.fn(*call.args, **call.kwargs)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def shipped_payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Serialize a call for workers on other machines, shipping the driver-local modules with it.

    The driver's ``sys.path`` travels too (entries on the workers' machines that exist are useful),
    minus the driver's own directory: its modules travel by value instead, so a remote worker and
    a local one behave the same.

    Raises:
        PayloadError: something cannot be pickled (the message names it).
    """
    root = driver_root()
    files = collect_modules(root)
    path = tuple(p for p in driver_sys_path() if root is None or (p and Path(p).resolve() != root))
    if not files:
        return serialize_call(fn, args, kwargs, sys_path=path)
    inner = serialize_call(fn, args, kwargs, sys_path=path)
    log.debug("shipping %d driver-local module file(s) from %s: %s", len(files), root, sorted(files))
    return serialize_call(run_with_modules, (files, inner), {}, sys_path=())
