"""The SparkContext a job runs on, the interpreter its executors run, and the task slots it has.

The user's active session is used as it is; with none, an embedded ``local[*]`` session is started (the
only setup a user needs is ``pip install phalanx[spark]`` and Java). Slots are counted the way Spark's
own barrier check counts them (``maxNumConcurrentTasks`` of the default resource profile), so a shortage
fails here in bounded time instead of in Spark's minutes-long silent retry loop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError, SlotsUnavailableError
from phalanx.job.progress import Progress
from phalanx.spark.connect import session as connect_session
from phalanx.spark.connect.session import active_connect_session, is_connect, ranks_asked

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from phalanx.spark.pyspark_types import SparkTarget

log = logging.getLogger(__name__)

#: Seconds between two "waiting for task slots" status lines.
SLOT_STATUS_EVERY_S = 5.0
_EMBEDDED_CONF = {
    "spark.app.name": "phalanx",
    "spark.ui.showConsoleProgress": "false",
    # Spark's own barrier slot check retries for minutes; phalanx checks first, so fail at once.
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
}


def spark_target(progress: bool = True) -> SparkTarget:
    """Where a job runs: the active Spark Connect session when there is one, else :func:`spark_context`
    (``progress``: say on stderr that an embedded Spark starts, when it does).

    Raises:
        InvalidArgumentError: pyspark is not installed.
    """
    session = active_connect_session()
    return session if session is not None else spark_context(progress)


def spark_context(progress: bool = True) -> SparkContext:
    """The active SparkContext, or a new embedded ``local[*]`` one (``progress``: say so on stderr while it
    starts; ``phalanx.spark.run(verbose=0)`` says nothing).

    Raises:
        InvalidArgumentError: pyspark is not installed (the message names the extra to install).
    """
    try:
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise InvalidArgumentError(
            "phalanx.spark needs pyspark: pip install 'phalanx[spark]' (and a Java runtime)"
        ) from e
    active = SparkSession.getActiveSession()
    if active is not None:
        return _classic_context(active)
    if SparkContext._active_spark_context is not None:
        return SparkContext._active_spark_context
    builder = SparkSession.builder.master("local[*]")
    for key, value in _EMBEDDED_CONF.items():
        builder = builder.config(key, value)
    log.info("no active SparkSession: starting an embedded local[*] one")
    starting = Progress(enabled=progress)
    starting.step("no active SparkSession: starting an embedded Spark local[*]")
    context = builder.getOrCreate().sparkContext
    starting.step(f"Spark local[*] ready ({context.defaultParallelism} task slots)")
    starting.clear()
    return context


def _classic_context(session: SparkSession) -> SparkContext:
    try:
        context: SparkContext = session.sparkContext
        return context
    except Exception as e:  # Spark Connect raises its own not-implemented error here
        raise InvalidArgumentError(
            f"the active SparkSession ({type(session).__module__}) has no SparkContext (Spark Connect?); "
            "phalanx.spark runs a barrier RDD stage, which needs a classic SparkSession: create one with "
            "SparkSession.builder.master(...) instead of .remote(...)"
        ) from e


def executor_python(sc: SparkContext) -> str:
    """The interpreter executors run: ``PYSPARK_PYTHON`` when the user set it, else the driver's own."""
    if os.environ.get(env_names.PYSPARK_PYTHON):
        return str(sc.pythonExec)
    return sys.executable


@contextmanager
def python_exec(sc: SparkContext, python: str) -> Iterator[None]:
    """Build RDDs whose tasks run ``python`` (the RDD keeps it; the context's default is restored)."""
    saved = sc.pythonExec
    sc.pythonExec = python
    try:
        yield
    finally:
        sc.pythonExec = saved


def driver_host(sc: SparkContext) -> str:
    """The address executors reach the driver at (``spark.driver.host``)."""
    host = sc.getConf().get("spark.driver.host")
    return host or "127.0.0.1"


def bind_address(sc: SparkContext) -> str:
    """The address the driver's channel and store listen on: Spark's own choice for the driver's sockets
    (``spark.driver.bindAddress``, which defaults to ``spark.driver.host``), never every interface."""
    conf = sc.getConf()
    return conf.get("spark.driver.bindAddress") or driver_host(sc)


def task_slots(sc: SparkContext) -> int:
    """How many tasks of the default resource profile the cluster can run at once right now."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def _is_local(sc: SparkContext) -> bool:
    master = str(sc.master)
    return master == "local" or master.startswith("local[")


def _shortage(sc: SparkContext, np: int, slots: int, waited_s: float, knob: str,
              ranks_per_task: int = 1) -> SlotsUnavailableError:
    conf = sc.getConf()
    cpus = conf.get("spark.task.cpus", "1")
    gpus = conf.get("spark.task.resource.gpu.amount")
    per_task = f"spark.task.cpus={cpus}" + (f", spark.task.resource.gpu.amount={gpus}" if gpus else "")
    return SlotsUnavailableError(
        f"{ranks_asked(np, ranks_per_task)} were asked for but the Spark cluster ({sc.master}) can run only {slots} "
        f"task(s) at once ({per_task}; waited {waited_s:.0f} s). A barrier stage needs every rank running "
        f"together: lower np/num_processes/num_proc to {max(slots, 1) * ranks_per_task} or less, give the "
        "cluster more executors, cores or GPUs (spark.executor.cores, spark.executor.instances, "
        f"spark.executor.resource.gpu.amount, local[N]), or raise {knob} to wait longer for executors to join"
    )


def wait_for_slots(sc: SparkContext, np: int, timeout_s: float, knob: str, ranks_per_task: int = 1) -> int:
    """Wait until the cluster can run the ``np / ranks_per_task`` tasks of ``np`` ranks at once (Spark counts a
    task's CPUs and GPUs); log a status line while waiting.

    Local masters never gain slots, so a shortage there fails at once.

    Args:
        sc: the context.
        np: ranks needed.
        timeout_s: seconds to wait for executors to join.
        knob: the argument that raises ``timeout_s``, named in the error.
        ranks_per_task: ranks each task runs (one per GPU of the task).

    Returns:
        The slots available.

    Raises:
        SlotsUnavailableError: fewer than ``np`` slots after ``timeout_s`` (the message has the values).
    """
    started = time.monotonic()
    next_status = started
    tasks = np // ranks_per_task
    while True:
        slots = task_slots(sc)
        now = time.monotonic()
        if slots >= tasks:
            return slots
        if _is_local(sc) or now - started >= timeout_s:
            raise _shortage(sc, np, slots, now - started, knob, ranks_per_task)
        if now >= next_status:
            log.warning("phalanx: waiting for task slots: %s asked for, %d slots available "
                        "(waited %.0f of %.0f s; %s)", ranks_asked(np, ranks_per_task), slots, now - started, timeout_s,
                        knob)
            next_status = now + SLOT_STATUS_EVERY_S
        time.sleep(0.25)


def every_slot(sc: SparkTarget, timeout_s: float, knob: str) -> int:
    """The number of task slots, for "one rank per slot" (``num_proc=None``, ``np=0``).

    Waits up to ``timeout_s`` for a first executor to join a cluster that has none yet. On a Spark
    Connect session the number comes from the session's settings.

    Raises:
        SlotsUnavailableError: still no slot after ``timeout_s``.
        InvalidArgumentError: a Connect session whose settings do not give the number.
    """
    if is_connect(sc):
        return connect_session.every_slot(sc)
    return wait_for_slots(sc, 1, timeout_s, knob)
