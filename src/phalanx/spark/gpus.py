"""How many GPUs a Spark job's tasks hold, and so how many ranks each barrier task runs.

pyspark's ``TorchDistributor`` runs ``num_processes / k`` tasks of ``k`` processes each (``torchrun
--nproc_per_node=k``) when every task holds ``k`` GPUs (``spark.task.resource.gpu.amount=k``), and refuses a
``num_processes`` that ``k`` does not divide; phalanx's Spark launchers do the same, with one rank per GPU.
``HorovodRunner``'s ``np`` and ``run``'s ``num_proc`` keep their meaning (processes, i.e. GPUs) on such a
cluster. The settings are read from the SparkConf, or from the session on Spark Connect.
"""

from __future__ import annotations

from phalanx.errors import InvalidArgumentError
from phalanx.spark.connect.session import conf, is_connect
from phalanx.spark.pyspark_types import ContextOrSession

#: The setting that gives each task its GPUs.
TASK_GPUS = "spark.task.resource.gpu.amount"


def _setting(sc: ContextOrSession, key: str) -> str | None:
    if is_connect(sc):
        return conf(sc, key)
    value = sc.getConf().get(key)
    return None if value is None else str(value)


def task_gpu_amount(sc: ContextOrSession) -> float:
    """GPUs each task of ``sc``'s default resource profile holds (0: none, or the setting is unreadable)."""
    amount = _setting(sc, TASK_GPUS)
    try:
        return max(0.0, float(amount)) if amount is not None else 0.0
    except ValueError:
        return 0.0


def check_gpu_conf(sc: ContextOrSession, use_gpu: bool) -> None:
    """Refuse ``use_gpu=True`` on a cluster whose tasks are given no GPU, before anything starts.

    Raises:
        InvalidArgumentError: ``spark.task.resource.gpu.amount`` is unset or zero.
    """
    if not use_gpu or task_gpu_amount(sc) > 0:
        return
    master = _setting(sc, "spark.master") if is_connect(sc) else sc.master
    raise InvalidArgumentError(
        f"use_gpu=True but this Spark cluster ({master}) gives its tasks no GPU "
        f"({TASK_GPUS}={_setting(sc, TASK_GPUS)!r}); set {TASK_GPUS}=1 and "
        "spark.executor.resource.gpu.amount (with spark.executor.resource.gpu.discoveryScript), or pass "
        "use_gpu=False to train on CPUs"
    )


def uses_gpus(sc: ContextOrSession) -> bool:
    """Whether each task holds one or more whole GPUs: then ``HorovodRunner`` and ``run`` pin each rank to
    one of them (``CUDA_VISIBLE_DEVICES`` in local-rank order, so ``hvd.local_rank()`` is its device index)."""
    return task_gpu_amount(sc) >= 1


def gpus_per_task(sc: ContextOrSession, use_gpu: bool) -> int:
    """Ranks each barrier task runs: ``k`` when GPUs are used and each task holds ``k > 1`` whole GPUs, else 1."""
    amount = task_gpu_amount(sc) if use_gpu else 0.0
    return int(amount) if amount > 1 and amount.is_integer() else 1


def ranks_per_task(sc: ContextOrSession, np: int, use_gpu: bool, what: str) -> int:
    """:func:`gpus_per_task`, checked against the ranks asked for.

    Args:
        sc: the SparkContext or Spark Connect session.
        np: ranks asked for.
        use_gpu: whether the ranks get their tasks' GPUs.
        what: the argument that gave ``np`` (``"num_processes"``, ``"np"``, ``"num_proc"``), for the error.

    Raises:
        InvalidArgumentError: ``np`` is not a multiple of ``k`` (pyspark's ``TorchDistributor`` refuses it too).
    """
    k = gpus_per_task(sc, use_gpu)
    if np % k:
        near = " or ".join(str(n) for n in sorted({np - np % k, np - np % k + k}) if n > 0)
        raise InvalidArgumentError(
            f"{what} ({np}) must be a multiple of '{TASK_GPUS}' ({k}): each Spark task holds {k} GPUs and runs "
            f"one rank per GPU; pass {what}={near}, or change {TASK_GPUS}"
        )
    return k
