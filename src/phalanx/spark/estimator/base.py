"""What every estimator's ``fit`` does on the driver: check, prepare the data, run the job, build the model.

A framework (torch, Keras, Lightning) gives three things: its checks of ``model`` / ``optimizer`` / ``loss``,
the bytes that carry its model to the ranks, and the training function each rank runs. The run is an
ordinary ``phalanx.spark`` job (``run_spec`` + ``launch_spark``): the embedded ``local[*]`` default, live
rank-prefixed logs, root-cause errors, the timeline (``HOROVOD_TIMELINE`` in ``env``) and GPU assignment.

The parameter values (``values``, a dict by name) are typed ``Any``: they hold the user's model, optimizer,
loss and callbacks besides settings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from pyspark.ml import Estimator

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError, PayloadError
from phalanx.launch.api import resolve_start_timeout
from phalanx.spark.api import launch_spark, run_spec
from phalanx.spark.common.backend import Backend, SparkBackend, num_proc_of
from phalanx.spark.estimator.job import TrainResult, TrainSpec
from phalanx.spark.estimator.params import PARAMS, EstimatorParams
from phalanx.spark.estimator.prepare import prepare
from phalanx.spark.estimator.schema import check_validation
from phalanx.spark.estimator.store import LocalStore, Store, check_run_id
from phalanx.spark.pyspark_types import SparkContextLike
from phalanx.spark.session import every_slot, spark_context

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from phalanx.spark.estimator.model import PhalanxModel

log = logging.getLogger("phalanx")

#: Parameters that stay on the driver (they travel in ``model_blob`` or are the driver's own business).
_DRIVER_ONLY = frozenset({"model", "optimizer", "store", "backend"})
_START_HINT = "the HOROVOD_SPARK_START_TIMEOUT variable"
#: The driver's variables the ranks get too (an estimator has no env= argument): the timeline.
_FORWARDED_ENV = (env_names.HOROVOD_TIMELINE, env_names.HOROVOD_TIMELINE_MARK_CYCLES)


def check_common(values: dict[str, Any]) -> None:
    """The checks every estimator shares, before any Spark job.

    Raises:
        InvalidArgumentError: naming the parameter, its value and what it must be.
    """
    if values.get("model") is None:
        raise InvalidArgumentError("model=None: give the estimator the model to train (model=...)")
    for name in ("feature_cols", "label_cols"):
        cols = values.get(name)
        if not cols or isinstance(cols, str) or not all(isinstance(c, str) for c in cols):
            raise InvalidArgumentError(f"{name}={cols!r}: give a non-empty list of column names")
    for name in ("batch_size", "epochs", "val_batch_size", "num_proc", "train_steps_per_epoch",
                 "validation_steps_per_epoch", "partitions_per_process"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"{name}={value!r}: give an integer >= 1")
    check_validation(values.get("validation"))
    store = values.get("store")
    if store is not None and not isinstance(store, Store):
        raise InvalidArgumentError(f"store={store!r}: give a phalanx Store (LocalStore(path) or Store.create(url))")
    if values.get("run_id") is not None:
        check_run_id(values["run_id"])


def pickled(obj: object, what: str) -> bytes:
    """``obj`` by cloudpickle, to carry it to the ranks.

    Raises:
        PayloadError: ``obj`` cannot be pickled (``what`` names it in the message).
    """
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(obj))
    except Exception as e:
        raise PayloadError(f"{what} cannot be pickled: {type(e).__name__}: {e}") from e


def default_store(sc: SparkContextLike) -> Store:
    """A temporary ``LocalStore`` in local mode; a cluster needs ``store=`` (a path every executor sees).

    Raises:
        InvalidArgumentError: ``store`` is unset on a cluster.
    """
    if str(sc.master).startswith("local"):
        return LocalStore(tempfile.mkdtemp(prefix="phalanx-estimator-"))
    raise InvalidArgumentError(
        f"store=None on the cluster {sc.master}: give store=Store.create(url) with a path every executor can "
        "write (HDFS, S3, DBFS, a shared mount)")


class PhalanxEstimator(Estimator, EstimatorParams):
    """The framework-independent half of an estimator (see the module docstring)."""

    framework = "model"

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, (default, _) in self.extra_params().items()})
        unknown = sorted(set(kwargs) - set(PARAMS) - set(self.extra_params()))
        if unknown:
            raise InvalidArgumentError(
                f"{type(self).__name__} got unknown parameter(s) {unknown}; its parameters are "
                f"{sorted(set(PARAMS) | set(self.extra_params()))}")
        self._set(**kwargs)

    # -- the framework's part ---------------------------------------------------------------------------
    @classmethod
    def extra_params(cls) -> dict[str, tuple[object, str]]:
        """Parameters beyond the shared ones (name -> (default, doc))."""
        return {}

    def check_framework(self, values: dict[str, Any]) -> None:
        """Framework checks of ``model``, ``optimizer``, ``loss`` (raise ``InvalidArgumentError``)."""

    def model_blob(self, values: dict[str, Any]) -> bytes:
        """The bytes that carry the model (and optimizer) to the ranks."""
        raise NotImplementedError

    def remote(self) -> Callable[[TrainSpec], TrainResult]:
        """The function every rank runs."""
        raise NotImplementedError

    def make_model(self, result: TrainResult, spec: TrainSpec) -> PhalanxModel:
        """The Spark ML ``Model`` from rank 0's result."""
        raise NotImplementedError

    def rank_env(self) -> dict[str, str]:
        """Variables the ranks need for this model (over the backend's ``env``): none by default."""
        return {}

    # -- fit ------------------------------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """Every parameter's value (set or default)."""
        names = set(PARAMS) | set(self.extra_params())
        return {name: self.getOrDefault(getattr(self, name)) for name in names}

    def _fit(self, dataset: DataFrame) -> PhalanxModel:
        values = self.values()
        check_common(values)
        self.check_framework(values)
        blob = self.model_blob(values)
        sc = spark_context()
        num_proc = (num_proc_of(values["num_proc"], values["backend"])
                    or every_slot(sc, resolve_start_timeout(None, spark=True), _START_HINT))
        store = values["store"] or default_store(sc)
        run_id = values["run_id"] or f"{self.framework}_{int(time.time())}_{uuid.uuid4().hex[:6]}"
        data = prepare(dataset, store, run_id, values, num_proc)
        last = store.last_checkpoint(run_id)
        if last is not None:
            log.warning("phalanx estimator: run %s resumes after epoch %d (%s)", run_id, last[0] + 1, last[1])
        params = {k: v for k, v in values.items() if k not in _DRIVER_ONLY}
        spec = TrainSpec(blob, data, store, run_id, params, last[0] if last else -1)
        results = self._run(spec, sc, num_proc, bool(values["use_gpu"]), values["backend"])
        return self.make_model(results[0], spec)

    def _run(self, spec: TrainSpec, sc: SparkContextLike, num_proc: int, use_gpu: bool, backend: Backend | None,
             ) -> list[TrainResult]:
        gpu = use_gpu and _task_gpus(sc)
        env = {name: os.environ[name] for name in _FORWARDED_ENV if name in os.environ} | self.rank_env()
        verbose = int(self.values()["verbose"] or 0)
        out = err = timeout = None
        if isinstance(backend, SparkBackend):  # its env, output streams and start timeout
            env = backend.job_env(env)
            options = backend.options()
            out, err, timeout = options["stdout"], options["stderr"], options["start_timeout"]
        job, sc = run_spec(self.remote(), (spec,), None, num_proc, timeout, env, out, err, verbose, {})
        job = dataclasses.replace(job, use_gpu=gpu, description=f"phalanx {type(self).__name__}.fit ({spec.run_id})")
        return cast("list[TrainResult]", launch_spark(job, sc).values)  # what remote() returned on each rank


def _task_gpus(sc: SparkContextLike) -> bool:
    # Horovod's use_gpu=True means "the GPUs if there are any": CPU clusters train on CPUs.
    amount = sc.getConf().get("spark.task.resource.gpu.amount")
    try:
        return amount is not None and float(amount) > 0
    except ValueError:
        return False
