"""torch-native code in a phalanx rank gets the shared-memory backend without code changes.

The worker entry calls :func:`install` before the user's function runs; in command ranks (``phalanxrun
python train.py``, a script given to a Spark launcher), which exec the user's program instead, the start-up
hook ``phalanx-shm-native.pth`` that the wheel installs does the same (``_phalanx_startup``) in every
interpreter started with the job's ``PHALANX_RUN_ID`` in its environment. It wraps
``torch.distributed.init_process_group`` (now if torch is already imported, else right after
``torch.distributed`` is first imported, through a one-shot import hook) so that a request for gloo, on a
job where some host runs two or more ranks, becomes a request for ``phalanx_shm``
(:mod:`phalanx.transport.backend`): allreduce, broadcast, barrier, all-gather-into-tensor and
reduce-scatter-tensor of CPU tensors go through shared memory among each host's ranks (across hosts,
hierarchically: gloo among the hosts' first ranks) and everything else through the gloo group it wraps.
``"gloo"`` (and ``"cpu:gloo,cuda:gloo"``) becomes ``"cpu:phalanx_shm,cuda:gloo"``, ``"cpu:gloo"`` becomes
``"cpu:phalanx_shm"``; the group then poses as gloo (:func:`phalanx.transport.backend.pose_as_gloo`):
``dist.get_backend()`` reports the name asked for and CUDA tensors go to the real gloo group. A request
that maps some device to another backend (``"cpu:gloo,cuda:nccl"``: a Python process group cannot hold
torch's NCCL backend beside it), any other backend (nccl, the default ``None``, mpi) and jobs with one
rank per host are left alone. On by
default, because DDP and FSDP2 on it are faster than on gloo (``bench/shm.py``; figures in BENCHMARKS.md);
``PHALANX_SHM_NATIVE=0`` or ``PHALANX_SHM=0`` turns it off.

This module imports nothing heavy: the backend module (torch) is imported by name only when a call is
substituted, once torch is fully initialised.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Any

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import SettingError
from phalanx.transport import native

SHM_BACKEND = native.BACKEND
_BACKEND_MODULE = native.BACKEND_MODULE
_TARGET = "torch.distributed"
_MARK = "__phalanx_shm_wrapped__"
_CLIENTS: list[Any] = []  # the job-store clients this process made (see job_store_arguments)


def _shares_a_host(environ: Mapping[str, str]) -> bool:
    """Whether some host runs two ranks of the job (the same answer on every rank): all ranks on this host
    (``LOCAL_WORLD_SIZE`` = ``WORLD_SIZE``), or fewer hosts than ranks (``GROUP_WORLD_SIZE``, the launchers'
    host count). A job with one rank per host keeps gloo: shared memory would carry nothing."""
    try:
        world = settings.first_int(environ, env_names.WORLD_SIZE, default=1)
        local = settings.first_int(environ, env_names.LOCAL_WORLD_SIZE, default=0)
        hosts = settings.first_int(environ, env_names.GROUP_WORLD_SIZE, default=0)
    except SettingError:
        return False
    return world >= 2 and (local == world or 0 < hosts < world)


def _x86_64() -> bool:
    """The transport is only known correct on x86-64 (docs/shm.md): elsewhere gloo is left alone."""
    return platform.machine().lower() in ("x86_64", "amd64")


def choose(backend: Any, environ: Mapping[str, str]) -> Any:
    """The backend to really use for ``init_process_group(backend)`` in a rank with ``environ``."""
    if not isinstance(backend, str) or not _shares_a_host(environ) or not _x86_64():
        return backend
    if not settings.SHM_NATIVE.get(environ) or not settings.SHM.get(environ):
        return backend
    devices = _gloo_devices(backend)
    if devices is None or "cpu" not in devices:
        return backend
    # the CPU first: torch creates no backend after a Python group's, so none is made in vain before it
    return ",".join([f"cpu:{SHM_BACKEND}", *(f"{d}:gloo" for d in devices if d != "cpu")])


def _gloo_devices(backend: str) -> list[str] | None:
    """The devices of a request that maps every device to gloo (``"gloo"``: gloo's cpu and cuda), in
    the request's order; None when some device gets another backend or the string is not a device map."""
    if backend.strip().lower() == "gloo":
        return ["cpu", "cuda"]
    devices: list[str] = []
    for part in backend.lower().split(","):
        device, _, name = part.strip().partition(":")
        if name != "gloo" or not device:
            return None
        devices.append(device)
    return devices


def job_store_arguments(call: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``init_process_group``'s keyword arguments with the job's authenticated store in place of an
    ``env://`` rendezvous (which would connect a ``TCPStore`` client to ``MASTER_ADDR:MASTER_PORT``).

    The store gets torchrun's agent-store prefix (``/worker/attempt_<restart>``), the timeout asked for
    (torch's default otherwise), and the rank and world size from the contract when not given. A call
    with a store or another ``init_method`` (``tcp://``, ``file://``), or outside a phalanx rank, is left
    alone.
    """
    if call.get("store") is not None or call.get("init_method") not in (None, "env://"):
        return call
    if not settings.SECRET.get(environ) or not environ.get(env_names.MASTER_ADDR):
        return call
    c10d: Any = sys.modules[f"{_TARGET}.distributed_c10d"]
    from phalanx.job.store_client import from_env  # imports torch, loaded by now

    timeout = call.get("timeout") or c10d.default_pg_timeout
    restart = settings.first_int(environ, env_names.TORCHELASTIC_RESTART_COUNT, default=0)
    client = from_env(environ, timeout)
    # torch keeps only the C++ half of a Python store: the Python object (its methods) must stay alive.
    _CLIENTS.append(client)
    store = c10d.PrefixStore(f"/worker/attempt_{restart}", client)
    rank = call.get("rank", -1)
    size = call.get("world_size", -1)
    return {**call, "init_method": None, "store": store,
            "rank": settings.first_int(environ, env_names.RANK, default=-1) if rank in (None, -1) else rank,
            "world_size": settings.first_int(environ, env_names.WORLD_SIZE, default=-1) if size in (None, -1) else size}


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        chosen = backend if native.backend_is_exact() else choose(backend, os.environ)
        call = dict(signature.bind_partial(chosen, *args, **kwargs).arguments)
        if chosen is backend:
            return original(**job_store_arguments(call, os.environ))
        module = importlib.import_module(_BACKEND_MODULE)  # registers the backend with torch.distributed
        result = original(**job_store_arguments(call, os.environ))
        module.pose_as_gloo(backend)
        return result

    setattr(init_process_group, _MARK, True)
    # phalanx.torch carries its own shared-memory transport: it calls inside ``native.exact_backend``.
    return init_process_group


def _patch() -> None:
    """Wrap ``init_process_group`` in the loaded ``torch.distributed`` (and its ``distributed_c10d``)."""
    for name in (_TARGET, f"{_TARGET}.distributed_c10d"):
        module: Any = sys.modules.get(name)
        fn = getattr(module, "init_process_group", None)
        if fn is not None and not getattr(fn, _MARK, False):
            module.init_process_group = _wrap(fn)


def patched_spec(fullname: str, after: Callable[[], None] | None = None) -> importlib.machinery.ModuleSpec | None:
    """``fullname``'s spec, with a loader that runs ``after`` (default :func:`_patch`) right after executing
    the module.

    Used by :class:`_AfterImport`, by the start-up hook ``phalanx-shm-native.pth`` (command ranks: the
    user's own ``python train.py`` started by ``phalanxrun`` or a Spark task, which never runs the worker
    entry) and by :mod:`phalanx.worker.deepspeed_ops`.
    """
    spec = importlib.util.find_spec(fullname)
    loader = spec.loader if spec is not None else None
    if loader is None or not hasattr(loader, "exec_module"):
        return spec
    run, then = loader.exec_module, after or _patch

    def exec_module(module: Any) -> None:
        run(module)
        then()

    loader.exec_module = exec_module  # type: ignore[method-assign]
    return spec


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_patch` right after ``torch.distributed`` is first imported, then steps aside."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        return patched_spec(fullname)


def install() -> None:
    """Substitute ``phalanx_shm`` for gloo in this process's ``init_process_group`` (idempotent)."""
    if _TARGET in sys.modules:
        _patch()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
