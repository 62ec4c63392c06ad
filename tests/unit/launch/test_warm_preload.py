"""What the warm-start template preloads for a job's function (``launch.warm.preload_for`` and the template's
own ``ALWAYS``), in one process."""

from __future__ import annotations

import phalanx.torch as hvd
from phalanx.launch.warm import preload_for
from phalanx.worker.template import ALWAYS


def _uses_hvd() -> int:
    return hvd.size()


def _uses_nothing() -> int:
    return 1


def test_the_template_always_imports_torch_and_the_transport_backend() -> None:
    assert {"torch", "torch.distributed", "phalanx.transport.backend"} <= set(ALWAYS)


def test_phalanx_torch_is_preloaded_only_for_a_function_that_uses_it() -> None:
    assert "phalanx.torch" not in preload_for(_uses_nothing)
    assert "phalanx.torch" in preload_for(_uses_hvd)
