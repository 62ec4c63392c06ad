"""What the warm-start template preloads for a job's function (``launch.warm.preload_for``), in one process."""

from __future__ import annotations

import phalanx.torch as hvd
from phalanx.launch.warm import preload_for


def _uses_hvd() -> int:
    return hvd.size()


def _uses_nothing() -> int:
    return 1


def test_the_transport_backend_is_always_preloaded_and_phalanx_torch_only_when_used() -> None:
    plain, with_hvd = preload_for(_uses_nothing), preload_for(_uses_hvd)
    assert "phalanx.transport.backend" in plain and "phalanx.transport.backend" in with_hvd
    assert "phalanx.torch" not in plain
    assert "phalanx.torch" in with_hvd
