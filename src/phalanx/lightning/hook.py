"""Registers ``"horovod"`` with each Lightning flavour right after it is imported (a one-shot import hook).

:func:`install` is called by ``import phalanx.lightning``, by phalanx's worker entry (function ranks, through
``phalanx.compat``) and, in command ranks (``phalanxrun python train.py``, scripts run by the Spark launchers),
by the wheel's start-up file ``phalanx-lightning.pth`` when the job's ``PHALANX_RUN_ID`` is set. Importing this
module imports nothing heavy, and the hook only compares module names until a flavour is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from typing import Any

from phalanx.lightning.registry import FLAVOURS, register

_log = logging.getLogger(__name__)


def _register_quietly(flavour: str) -> None:
    # A Lightning that phalanx cannot hook must still import: the user's own strategies keep working.
    try:
        register(flavour)
    except Exception as e:
        _log.warning("phalanx: could not register strategy 'horovod' with %s: %s", flavour, e)


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after a flavour's top module is executed (its registry is then full)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in FLAVOURS or getattr(self._local, "busy", False):
            return None
        self._local.busy = True  # find_spec below asks sys.meta_path again, this finder included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._local.busy = False
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register_quietly(fullname)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def installed() -> bool:
    """Whether the hook is on ``sys.meta_path``."""
    return any(isinstance(f, _AfterLightning) for f in sys.meta_path)


def install() -> None:
    """Register ``"horovod"`` with every flavour already imported, and with the others when they are (idempotent)."""
    for flavour in FLAVOURS:
        if flavour in sys.modules:
            _register_quietly(flavour)
    if not installed():
        sys.meta_path.insert(0, _AfterLightning())
