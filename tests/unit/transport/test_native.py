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
    assert calls == [f"cpu:{native.BACKEND},cuda:gloo", "gloo"]


def test_a_substituted_gloo_group_poses_as_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """get_backend() reports gloo, the device map keeps gloo's CUDA entry, and a tensor of another device
    than the CPU (a meta tensor here: no GPU) goes to the wrapped gloo group, never to shared memory."""
    import torch
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("PHALANX_SECRET", raising=False)
    init = dist_backend._wrap(dist.distributed_c10d.init_process_group)
    init("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: the group wraps gloo alone
    try:
        pg = dist.distributed_c10d._get_default_group()
        assert pg.getBackendName() == native.BACKEND
        assert dist.get_backend() == "gloo" and dist.get_backend() == dist.Backend.GLOO
        assert dist.get_backend_config() == f"cpu:{native.BACKEND},cuda:gloo"
        assert set(pg._device_types) == {torch.device("cpu"), torch.device("cuda")}
        for device in ("cpu", "cuda"):
            assert isinstance(pg._get_backend(torch.device(device)), dist.ProcessGroupGloo)
        sent: list[str] = []
        pg.gloo = type("Gloo", (), {"allreduce": lambda self, ts, opts: sent.append(ts[0].device.type)})()
        pg.allreduce([torch.empty(4, device="meta")])
        assert sent == ["meta"]
        sub = dist.new_group([0])  # inherits the name asked for: plain gloo
        assert dist.get_backend(sub) == "gloo" and not hasattr(sub, "shm_calls")
    finally:
        dist.destroy_process_group()
