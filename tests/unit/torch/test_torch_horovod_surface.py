"""Horovod's names in ``horovod.torch`` / ``horovod.torch.mpi_ops``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import phalanx.torch as hvd
from phalanx.torch import mpi_ops

# Every public name of horovod/torch/mpi_ops.py in Horovod 0.28.1, except the modules it imports (torch,
# warnings) and its compiled extension (mpi_lib).
HOROVOD_MPI_OPS = """
Adasum Average Compression HorovodAllgather HorovodAllreduce HorovodAlltoall HorovodBroadcast
HorovodGroupedAllgather HorovodGroupedAllreduce HorovodGroupedReducescatter HorovodInternalError
HorovodReducescatter Max Min ProcessSet Product Sum add_process_set allgather allgather_async allreduce
allreduce_ allreduce_async allreduce_async_ alltoall alltoall_async barrier broadcast broadcast_
broadcast_async broadcast_async_ ccl_built check_installed_version cross_rank cross_size cuda_built
ddl_built get_average_backwards_compatibility_fun global_process_set gloo_built gloo_enabled gpu_available
grouped_allgather grouped_allgather_async grouped_allreduce grouped_allreduce_ grouped_allreduce_async
grouped_allreduce_async_ grouped_reducescatter grouped_reducescatter_async
handle_average_backwards_compatibility init is_homogeneous is_initialized join local_rank local_size
mpi_built mpi_enabled mpi_threads_supported nccl_built num_rank_is_power_2 poll rank reducescatter
reducescatter_async remove_process_set rocm_built shutdown size sparse_allreduce_async start_timeline
stop_timeline synchronize
""".split()


def test_mpi_ops_has_every_horovod_name() -> None:
    missing = [n for n in HOROVOD_MPI_OPS if not hasattr(mpi_ops, n)]
    assert missing == []
    assert sorted(mpi_ops.__all__) == sorted(HOROVOD_MPI_OPS)
    from horovod.torch.mpi_ops import Sum, allreduce_async_, synchronize  # noqa: F401  (the alias)


def test_exceptions_and_helpers() -> None:
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.sparse_allreduce_async is mpi_ops.sparse_allreduce_async
    assert mpi_ops.handle_average_backwards_compatibility(None, True) == hvd.Average
    assert mpi_ops.handle_average_backwards_compatibility(hvd.Sum, None) == hvd.Sum
    assert mpi_ops.get_average_backwards_compatibility_fun(None)(None, False) == hvd.Sum
    assert [mpi_ops.num_rank_is_power_2(n) for n in (1, 2, 3, 4, 6, 8)] == [True, True, False, True, False, True]


@pytest.fixture
def single() -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


def test_init_rejects_an_unknown_process_sets_string() -> None:
    with pytest.raises(ValueError, match="'dynamic'"):
        hvd.init(process_sets="static")
    assert not hvd.is_initialized()


def test_init_dynamic_allows_adding_process_sets(single: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    with pytest.raises(ValueError, match="dynamic"):
        hvd.add_process_set([0])
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    with pytest.raises(ValueError, match=r"duplicate process set: \[0\]"):  # one rank: [0] is the global set
        hvd.add_process_set([0])


def test_process_set_takes_any_iterable_sorted_and_prints_as_horovod() -> None:
    assert hvd.ProcessSet(reversed(range(1, 4))).ranks == [1, 2, 3]
    assert hvd.ProcessSet(r for r in (5, 0)).ranks == [0, 5]
    assert hvd.ProcessSet({2, 1}).ranks == [1, 2]
    assert str(hvd.ProcessSet([3, 1])) == "ProcessSet(process_set_id=None, ranks=[1, 3], mpi_comm=None)"
    for bad in (3, "01", [0, "1"], [1.0], [0, 0]):
        with pytest.raises(ValueError):
            hvd.ProcessSet(bad)  # type: ignore[arg-type]
