"""CUDA tensors never take the CPU path, checked here without a GPU: a non-CPU tensor (torch's ``meta`` device
stands in for CUDA) is never routed to the shared-memory transport or copied to the host, NCCL is the CUDA
backend of phalanx.torch's group when CUDA is there, mixed-device groups are refused with a clear error, and
the ranks' NICs and GPUs are set as a multi-NIC, multi-GPU node needs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.env.contract import nic_env
from phalanx.errors import InvalidArgumentError
from phalanx.launch.agent_driver import plan_env

# white-box: the engine's CUDA paths, checked without a GPU: internal (no public name)
from phalanx.torch._engine import header as _header
from phalanx.torch._setup import state as _state
from phalanx.transport import _dispatch, api


def test_a_non_cpu_tensor_goes_to_torch_distributed_never_to_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    group = object()
    calls: list[str] = []

    class _Transport:  # registered like a real one: a CPU tensor would be carried by it
        def __getattr__(self, name: str) -> Any:
            calls.append(f"shm.{name}")
            raise AssertionError("the shared-memory transport was used")

    monkeypatch.setitem(_dispatch._ROUTES, id(group), (_Transport(), "data"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(f"dist.all_reduce:{t.device.type}"))
    monkeypatch.setattr(dist, "all_gather_into_tensor",
                        lambda out, t, **kw: calls.append(f"dist.all_gather:{t.device.type}"), raising=False)
    cuda_like = torch.empty(4, device="meta")
    api.all_reduce(cuda_like, group=group)
    assert calls == ["dist.all_reduce:meta"]
    assert _dispatch._route(group, torch.ones(4)) is not None  # a CPU tensor would take shared memory


def test_nccl_is_the_cuda_backend_of_the_default_group_when_cuda_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert _state._backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _state._backend() == "gloo"


def test_cuda_payloads_are_never_inlined_in_the_cpu_control_block() -> None:
    # white-box: the engine's inlining choice: internal (no public name)
    from phalanx.torch._engine import core as _engine

    class _Coll:
        sig = _header.Signature("allreduce", "g", torch.float32, 1, (4,))

        def payload_bytes(self) -> torch.Tensor:
            raise AssertionError("a CUDA tensor's bytes were read for the control block")

    assert _engine._inline_candidate(_Coll()) is None  # type: ignore[arg-type]


def test_a_grouped_allreduce_mixing_devices_is_refused_naming_them() -> None:
    import phalanx.torch as hvd

    with pytest.raises(InvalidArgumentError, match=r"different devices \(cpu, meta\).*one device"):
        hvd.grouped_allreduce([torch.ones(2), torch.empty(2, device="meta")], name="mixed")


def test_ranks_disagreeing_on_the_device_get_the_mismatch_with_the_fix() -> None:
    cpu = _header.Signature("allreduce", "w", torch.float32, 0, (4,))
    cuda = _header.Signature("allreduce", "w", torch.float32, 1, (4,))
    detail = _header.find_mismatch([cuda, cpu], [0, 1])
    assert detail == "device: rank 0=cuda, rank 1=cpu"
    message = str(_header.mismatch_error([cuda, cpu], [0, 1], detail, 1))
    assert "cannot mix CPU and CUDA tensors" in message


def test_network_interfaces_set_nccl_and_gloo_socket_ifname_unless_the_user_did() -> None:
    assert nic_env(("eth1", "eth2")) == {"NCCL_SOCKET_IFNAME": "eth1,eth2", "GLOO_SOCKET_IFNAME": "eth1,eth2"}
    assert nic_env(()) == {}
    assert nic_env(["ib0"], {"NCCL_SOCKET_IFNAME": "=ib0"}) == {"GLOO_SOCKET_IFNAME": "ib0"}
    # the agents' ranks: over a value inherited from the driver's environment, under the user's -x
    env = plan_env({"NCCL_SOCKET_IFNAME": "docker0", "HOME": "/h"}, {}, ("eth1",), {})
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("eth1", "eth1") and "HOME" not in env
    env = plan_env({}, {"GLOO_SOCKET_IFNAME": "lo"}, ("eth1",), {})
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("eth1", "lo")


def test_spark_run_nics_reach_the_ranks_and_bad_ones_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.spark import api

    monkeypatch.setattr(api, "spark_target", lambda progress=True: _NoGpuContext())
    spec, _ = api.run_spec(len, (), None, 2, None, None, None, None, 1, {"nics": ["eth1"], "use_mpi": True})
    assert (spec.env["NCCL_SOCKET_IFNAME"], spec.env["GLOO_SOCKET_IFNAME"]) == ("eth1", "eth1")
    with pytest.raises(InvalidArgumentError, match="nics must be network interface names"):
        api.run_spec(len, (), None, 2, None, None, None, None, 1, {"nics": 3})


class _NoGpuContext:
    master = "local[2]"

    def getConf(self) -> Any:
        return {}


def test_local_mode_gpus_are_the_drivers_own_when_a_cluster_manager_restricted_them() -> None:
    from phalanx.spark.distributor import driver_gpus

    assert driver_gpus({"CUDA_VISIBLE_DEVICES": "4,6"}) == ["4", "6"]
    assert driver_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
