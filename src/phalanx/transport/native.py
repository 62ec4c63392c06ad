"""What the ``phalanx_shm`` substitution (``phalanx.worker.dist_backend``) and its callers share, without torch.

In a rank started by phalanx, ``torch.distributed.init_process_group`` may be wrapped so that a request
for gloo becomes one for :data:`BACKEND` (the module :data:`BACKEND_MODULE` registers it). phalanx.torch
carries its own transport and must get exactly the backend it asks for: it calls ``init_process_group``
inside :func:`exact_backend`, and the wrapper leaves the backend alone while :func:`backend_is_exact`
(everything else the wrapper does, such as the job's authenticated store, still applies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: The ``torch.distributed`` backend name of the shared-memory process group (``backend.ShmProcessGroup``).
BACKEND = "phalanx_shm"
#: The module whose import registers :data:`BACKEND` with ``torch.distributed``.
BACKEND_MODULE = "phalanx.transport.backend"
_EXACT: ContextVar[bool] = ContextVar("phalanx_exact_backend", default=False)


@contextmanager
def exact_backend() -> Iterator[None]:
    """Within this block (this thread or task), ``init_process_group`` keeps the backend asked for."""
    token = _EXACT.set(True)
    try:
        yield
    finally:
        _EXACT.reset(token)


def backend_is_exact() -> bool:
    """Whether the caller is inside :func:`exact_backend`."""
    return _EXACT.get()
