"""The ``sys.meta_path`` finder behind the ``horovod`` / ``sparkdl`` / ``petastorm`` aliases.

It sits at the front of ``sys.meta_path`` but declines a top-level name (``horovod``, ``sparkdl``,
``petastorm``) whenever another finder can import the real package, so an installed Horovod (or
Databricks' ``sparkdl``, or Petastorm) always wins; submodules are aliased only under an aliased parent.
(Being first matters: ``horovod.torch`` *is* ``phalanx.torch``, whose ``__path__`` would otherwise let the
path finder load ``horovod.torch.mpi_ops`` as a second copy of ``phalanx/torch/mpi_ops.py``.) Nothing is
looked up or imported until someone imports an aliased name: the finder costs nothing at interpreter start.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

# Alias -> phalanx module it is (the same module object, so hvd.init state is shared).
MODULE_ALIASES = {
    "horovod.torch": "phalanx.torch",
    "horovod.spark": "phalanx.spark",
    "horovod.tensorflow": "phalanx.tensorflow",
    "horovod.keras": "phalanx.tensorflow.keras",
    # Horovod's estimator modules (horovod.spark.torch.estimator...): phalanx's estimator of each framework.
    "horovod.spark.torch.estimator": "phalanx.spark.estimator.torch",
    "horovod.spark.keras.estimator": "phalanx.spark.estimator.keras",
    "horovod.spark.lightning.estimator": "phalanx.spark.estimator.lightning",
    # ``python -m horovod.runner.launch`` and ``horovodrun``'s entry (run_commandline): a module, not a package.
    "horovod.runner.launch": "phalanx.compat.horovodrun",
}
#: Aliases of a plain module that ``python -m`` runs: their spec is not a package's, their loader gives code.
RUNNABLE = frozenset({"horovod.runner.launch"})
#: Horovod packages that phalanx implements as plain modules: the alias gives the module an empty
#: ``__path__`` so that Horovod's submodule names under it (the ``estimator`` aliases above) can resolve.
PACKAGE_ALIASES = frozenset({"horovod.spark.torch", "horovod.spark.keras", "horovod.spark.lightning"})
# Prefixes whose submodules map one to one (horovod.torch.mpi_ops -> phalanx.torch.mpi_ops).
PREFIX_ALIASES = {
    "horovod.torch.": "phalanx.torch.", "horovod.spark.": "phalanx.spark.",
    "horovod.tensorflow.": "phalanx.tensorflow.", "horovod.keras.": "phalanx.tensorflow.keras.",
}
_CONVERTER = {"make_spark_converter": ("phalanx.spark.converter", "make_spark_converter"),
              "SparkDatasetConverter": ("phalanx.spark.converter", "SparkDatasetConverter")}
# Synthetic packages: name -> {attribute: (phalanx module, attribute)}, resolved lazily on access.
SYNTHETIC: dict[str, dict[str, tuple[str, str]]] = {
    "horovod": {"run": ("phalanx.compat.horovod_run", "run")},
    "horovod.runner": {"run": ("phalanx.compat.horovod_run", "run")},
    # Horovod's framework-neutral elastic base classes and exceptions.
    "horovod.common": {},
    "horovod.common.util": {"env": ("phalanx.compat.horovod_util", "env")},
    "horovod.common.elastic": {"State": ("phalanx.torch.elastic.state", "State"),
                               "ObjectState": ("phalanx.torch.elastic.state", "ObjectState")},
    "horovod.common.exceptions": {"HorovodInternalError": ("phalanx.errors", "HorovodInternalError"),
                                  "HostsUpdatedInterrupt": ("phalanx.errors", "HostsUpdatedInterrupt")},
    "sparkdl": {"HorovodRunner": ("phalanx.spark", "HorovodRunner")},
    "sparkdl.horovod": {"log_to_driver": ("phalanx.spark", "log_to_driver")},
    "sparkdl.horovod.tensorflow": {},
    "sparkdl.horovod.tensorflow.keras": {"LogCallback": ("phalanx.spark.keras_log", "LogCallback")},
    # Petastorm's Spark converter, its loader and its transform hook (phalanx.spark.converter).
    "petastorm": {"TransformSpec": ("phalanx.spark.transform", "TransformSpec")},
    "petastorm.transform": {"TransformSpec": ("phalanx.spark.transform", "TransformSpec")},
    "petastorm.spark": _CONVERTER,
    "petastorm.spark.spark_dataset_converter": _CONVERTER,
    "petastorm.pytorch": {"DataLoader": ("phalanx.spark.loader", "DataLoader"),
                          "BatchedDataLoader": ("phalanx.spark.loader", "DataLoader")},
}


def target_of(fullname: str) -> str | None:
    """The phalanx module an alias stands for, or None (synthetic packages and unknown names)."""
    if fullname in MODULE_ALIASES:
        return MODULE_ALIASES[fullname]
    for prefix, real in PREFIX_ALIASES.items():
        if fullname.startswith(prefix):
            return real + fullname[len(prefix) :]
    return None


TOP_LEVEL = ("horovod", "sparkdl", "petastorm")
ALIAS_MARK = "__phalanx_alias__"


def _synthetic(name: str, attrs: dict[str, tuple[str, str]]) -> types.ModuleType:
    module = types.ModuleType(name, f"phalanx alias for {name!r}: {sorted(attrs)} resolve to phalanx.")
    module.__path__ = []  # a package: its submodules are aliases too
    module.__file__ = __file__  # tools and inspect read it: the file that defines the alias
    setattr(module, ALIAS_MARK, True)

    def __getattr__(attr: str) -> Any:
        if attr in attrs:
            mod, obj = attrs[attr]
            return getattr(importlib.import_module(mod), obj)
        raise AttributeError(f"module {name!r} (a phalanx alias) has no attribute {attr!r}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    if name == "horovod":  # Horovod's API version; phalanx's own stays phalanx.__version__
        from phalanx import HOROVOD_API_VERSION

        module.__version__ = HOROVOD_API_VERSION  # type: ignore[attr-defined]
    return module


class AliasLoader(importlib.abc.Loader):
    """Loads an alias: the real phalanx module (shared, not a copy) or a synthetic package."""

    def __init__(self, fullname: str) -> None:
        self.fullname = fullname
        self._original_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        target = target_of(self.fullname)
        if target is None:
            return _synthetic(self.fullname, SYNTHETIC[self.fullname])
        module = importlib.import_module(target)
        self._original_spec = module.__spec__
        if self.fullname in PACKAGE_ALIASES and not hasattr(module, "__path__"):
            module.__path__ = []  # finders see no file under it: aliases only
        return module

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The code of the module an alias stands for (``python -m horovod.runner.launch`` runs it)."""
        target = target_of(fullname)
        spec = importlib.util.find_spec(target) if target else None
        get = getattr(spec.loader, "get_code", None) if spec is not None else None
        return get(target) if get is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        # importlib set module.__spec__ to the alias's spec; the real module keeps its own identity.
        if self._original_spec is not None:
            module.__spec__ = self._original_spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``horovod``, ``horovod.{torch,spark,tensorflow,keras}[.*]``, ``sparkdl``, ``sparkdl.horovod[...]``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in TOP_LEVEL:
            return None
        if fullname == top:
            if self._real_package_exists(top):
                return None
        elif not getattr(sys.modules.get(top), ALIAS_MARK, False):
            return None  # the real package was imported: its submodules are its own business
        if fullname not in SYNTHETIC:
            real = target_of(fullname)
            if real is None or importlib.util.find_spec(real) is None:
                return None
        return importlib.machinery.ModuleSpec(fullname, AliasLoader(fullname), is_package=fullname not in RUNNABLE)

    def _real_package_exists(self, name: str) -> bool:
        return real_package_exists(name)


def real_package_exists(name: str) -> bool:
    """Whether a finder other than phalanx's aliases can import the top-level package ``name`` (the real
    Horovod or sparkdl)."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder) or _is_lazy_hook(finder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is not None and find(name, None) is not None:
            return True
    return False


LAZY_HOOK_NAME = "PhalanxLazyAliasHook"  # _phalanx_startup's finder (phalanx-compat.pth), superseded here


def _is_lazy_hook(finder: object) -> bool:
    return getattr(finder, "__name__", "") == LAZY_HOOK_NAME


def installed() -> bool:
    """Whether the alias finder is on ``sys.meta_path``."""
    return any(isinstance(f, AliasFinder) for f in sys.meta_path)


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (idempotent)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_lazy_hook(f)]  # superseded
    if not installed():
        sys.meta_path.insert(0, AliasFinder())


def uninstall() -> None:
    """Remove the alias finder (aliases already imported stay in ``sys.modules``)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]
