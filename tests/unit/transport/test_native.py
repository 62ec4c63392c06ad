"""The ``phalanx_shm`` substitution's explicit way around it (``transport.native``), in one process: the
worker's wrapper substitutes for torch-native callers and keeps the backend inside ``exact_backend``."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.transport import native
from phalanx.worker import dist_backend


def test_the_wrapper_substitutes_except_inside_exact_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("PHALANX_SECRET", raising=False)  # no job store: the wrapper only picks the backend
    calls: list[Any] = []

    def init_process_group(backend: Any = None, init_method: Any = None) -> None:
        calls.append(backend)

    wrapper = dist_backend._wrap(init_process_group)
    wrapper("gloo")
    with native.exact_backend():
        assert native.backend_is_exact()
        wrapper("gloo")
    assert not native.backend_is_exact()
    assert calls == [native.BACKEND, "gloo"]
