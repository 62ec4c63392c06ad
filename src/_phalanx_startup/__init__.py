"""phalanx's interpreter start-up hooks: what the wheel's ``.pth`` files call, one line each.

``phalanx-compat.pth`` calls :func:`install_alias_hook`, ``phalanx-shm-native.pth``
:func:`install_shm_native_hook` and ``phalanx-lightning.pth`` :func:`install_lightning_hook`. The first two
put a finder at the front of ``sys.meta_path`` that imports phalanx only when the name it waits for is
first imported, then steps aside; the last imports ``phalanx.lightning.hook`` in a rank of a phalanx job
only. So an interpreter outside a job that never imports those names loads nothing of phalanx. That is
why this is a top-level module of its own (as setuptools' ``_distutils_hack``): importing anything under
``phalanx`` would run ``phalanx/__init__.py`` in every interpreter of the environment.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec
from typing import Any

#: ``phalanx.env.names.PHALANX_RUN_ID``, spelled out because start-up must not import phalanx (a test holds
#: the two equal): set in every rank of a phalanx job, and only there.
RUN_ID_VARIABLE = "PHALANX_RUN_ID"
#: The top-level names the horovod / sparkdl aliases answer (``phalanx.compat``).
ALIASED = ("horovod", "sparkdl", "petastorm")
#: The module whose first import installs the ``phalanx_shm`` substitution (``phalanx.worker.dist_backend``).
DISTRIBUTED = "torch.distributed"
#: The module whose ``install()`` registers strategy ``"horovod"`` with Lightning once it is imported.
LIGHTNING_HOOK = "phalanx.lightning.hook"


def _step_aside(hook: type) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if f is not hook]


class PhalanxLazyAliasHook:
    """Loads the horovod / sparkdl alias finder (``phalanx.compat``) when one of those names is first
    imported; the name is the one ``phalanx.compat`` looks for when it replaces this hook."""

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        """The alias's spec for ``horovod`` / ``sparkdl`` names (None for any other name)."""
        if name.partition(".")[0] not in ALIASED:
            return None
        _step_aside(PhalanxLazyAliasHook)
        try:
            from phalanx.compat import _finder
        except ImportError:  # phalanx uninstalled under a stale .pth: behave as if absent
            return None
        _finder.install()
        return _finder.AliasFinder().find_spec(name, path, target)


class PhalanxShmNativeHook:
    """Substitutes ``phalanx_shm`` for gloo in this rank once ``torch.distributed`` is first imported
    (``phalanx.worker.dist_backend``), and wraps DeepSpeed's op building as its modules are imported
    (``phalanx.worker.deepspeed_ops``); for command ranks, which never run phalanx's worker entry."""

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        """``torch.distributed``'s spec with the substitution attached (None for any other name)."""
        if name != DISTRIBUTED:
            return None
        _step_aside(PhalanxShmNativeHook)
        try:
            from phalanx.worker import deepspeed_ops, dist_backend
        except ImportError:  # phalanx uninstalled under a stale .pth: behave as if absent
            return None
        deepspeed_ops.install()
        return dist_backend.patched_spec(name)


def install_alias_hook() -> None:
    """Put :class:`PhalanxLazyAliasHook` first on ``sys.meta_path`` (``phalanx-compat.pth``)."""
    if PhalanxLazyAliasHook not in sys.meta_path:
        sys.meta_path.insert(0, PhalanxLazyAliasHook)


def install_shm_native_hook(environ: Mapping[str, str] = os.environ) -> None:
    """Put :class:`PhalanxShmNativeHook` first on ``sys.meta_path`` in a rank of a phalanx job (``environ``
    has :data:`RUN_ID_VARIABLE`); elsewhere do nothing (``phalanx-shm-native.pth``)."""
    if environ.get(RUN_ID_VARIABLE) and PhalanxShmNativeHook not in sys.meta_path:
        sys.meta_path.insert(0, PhalanxShmNativeHook)


def install_lightning_hook(environ: Mapping[str, str] = os.environ) -> None:
    """In a rank of a phalanx job (``environ`` has :data:`RUN_ID_VARIABLE`), install :data:`LIGHTNING_HOOK`
    (command ranks never run the worker entry, which installs it for function ranks); elsewhere do nothing
    (``phalanx-lightning.pth``)."""
    if environ.get(RUN_ID_VARIABLE):
        importlib.import_module(LIGHTNING_HOOK).install()
