"""What a Spark Connect session can tell phalanx: whether it is one, its settings, its task slots, and
the address its executors would reach this client at.

A Connect client has no SparkContext: no ``maxNumConcurrentTasks``, no executor list, no driver-side
``pythonExec``. The task slots are counted from the server's settings instead (``spark.master``,
``spark.executor.instances``, ``spark.executor.cores``, ``spark.task.cpus``), which is exact for
``local[N]`` and ``local-cluster`` masters and for a static cluster once its executors joined. For
``local[*]`` a one-task query asks the server's host for its cores (a local master's executors are the
server's own JVM). Spark refuses barrier stages under dynamic allocation, so that is an error before any
query. When the settings do not say (a cluster without ``spark.executor.instances``), the stage is
submitted and the client's start watch (:class:`StageWatch`) turns a stage that never starts into a
``SlotsUnavailableError`` after ``start_timeout`` (docs/spark.md, "Spark Connect").
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from phalanx.env import settings
from phalanx.errors import InvalidArgumentError, SlotsUnavailableError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.connect.session import SparkSession as ConnectSession
    from pyspark.sql.connect.shell.progress import StageInfo
    from typing_extensions import TypeIs

    from phalanx.spark.pyspark_types import SessionLike

_LOCAL = re.compile(r"local(?:\[(\d+|\*)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]$")


def is_connect(session: object) -> TypeIs[ConnectSession]:
    """True when ``session`` is a Spark Connect ``SparkSession``."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def active_connect_session() -> ConnectSession | None:
    """The active Spark Connect session, or None (no pyspark, no Connect client, or a classic session)."""
    try:
        from pyspark.sql.utils import is_remote
    except ImportError:
        return None
    if not is_remote():
        return None
    from pyspark.sql.connect.session import SparkSession

    # The active session is per thread; the default one (the first created) serves other threads, as in
    # pyspark's own SparkSession.active().
    session: SparkSession | None = (SparkSession.getActiveSession()
                                    or getattr(SparkSession, "_default_session", None))
    if session is None or getattr(session, "is_stopped", False):
        return None
    return session if is_connect(session) else None


def conf(session: SessionLike, key: str) -> str | None:
    """A setting of the session (``spark.conf.get``), or None when it is unset or the server hides it."""
    try:
        value = session.conf.get(key, None)
    except Exception:  # the server refuses some keys (and errors are Connect's own classes)
        return None
    return None if value is None else str(value)


def task_slots(session: ConnectSession) -> int | None:
    """Tasks the session's cluster runs at once, from its settings; None when the settings do not say."""
    master = conf(session, "spark.master") or ""
    per_task = int(float(conf(session, "spark.task.cpus") or 1))
    local, cluster = _LOCAL.match(master), _LOCAL_CLUSTER.match(master)
    cores: int | None
    if local is not None:
        cores = 1 if master == "local" else server_cores(session) if local.group(1) == "*" else int(local.group(1))
    elif cluster is not None:
        cores = int(cluster.group(1)) * int(cluster.group(2))
    else:
        cores = _static_cluster_cores(session)
    if cores is None:
        return None
    gpu_bound = None if local is not None or _dynamic_allocation(session) else _gpu_slots(session)
    return cores // max(per_task, 1) if gpu_bound is None else min(cores // max(per_task, 1), gpu_bound)


def _host_cores(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa

    for _ in batches:
        pass
    # The CPUs this process may run on: what the JVM's availableProcessors counts for local[*] (its cgroup
    # CPU quota aside).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    yield pa.RecordBatch.from_pydict({"cores": [cores]})


_server_cores: dict[str, int] = {}
_server_cores_lock = threading.Lock()


def server_cores(session: ConnectSession) -> int:
    """The cores of the Connect server's host (one small query per session; for ``local[*]``, whose
    executors are the server's JVM)."""
    key = str(getattr(session, "session_id", id(session)))
    with _server_cores_lock:
        if key not in _server_cores:
            rows = session.range(0, 1, 1, 1).mapInArrow(_host_cores, "cores long").collect()
            _server_cores[key] = int(rows[0]["cores"])
        return _server_cores[key]


def _dynamic_allocation(session: SessionLike) -> bool:
    master = conf(session, "spark.master") or ""
    on = (conf(session, "spark.dynamicAllocation.enabled") or "false").lower() == "true"
    return on and not master.startswith("local")


def _static_cluster_cores(session: SessionLike) -> int | None:
    if _dynamic_allocation(session):
        return None
    instances, cores = conf(session, "spark.executor.instances"), conf(session, "spark.executor.cores")
    if instances is None or cores is None:
        return None
    return int(instances) * int(cores)


def _gpu_slots(session: SessionLike) -> int | None:
    """Tasks the executors' GPUs allow at once on a cluster master (``spark.executor.instances`` x
    ``spark.executor.resource.gpu.amount`` / ``spark.task.resource.gpu.amount``); None when not bounded."""
    instances = conf(session, "spark.executor.instances")
    executor = conf(session, "spark.executor.resource.gpu.amount")
    task = conf(session, "spark.task.resource.gpu.amount")
    try:
        if instances is None or executor is None or task is None or float(task) <= 0:
            return None
        return int(instances) * int(float(executor) / float(task))
    except ValueError:
        return None


def ranks_asked(np: int, ranks_per_task: int) -> str:
    """How a slot error names the ranks asked for: ``"8 ranks (2 tasks of 4 GPUs each)"``."""
    if ranks_per_task == 1:
        return f"{np} ranks"
    return f"{np} ranks ({np // ranks_per_task} tasks of {ranks_per_task} GPUs each)"


def check_slots(session: ConnectSession, np: int, ranks_per_task: int = 1) -> None:
    """Refuse a job the session's cluster cannot run at once (``np / ranks_per_task`` tasks), when its settings
    say so.

    Raises:
        SlotsUnavailableError: fewer slots than ``np``, or dynamic allocation (Spark refuses barrier
            stages under it); the message has the values and what to change.
    """
    if _dynamic_allocation(session):
        raise SlotsUnavailableError(
            f"the Spark Connect session's cluster ({conf(session, 'spark.master')}) runs with "
            "spark.dynamicAllocation.enabled=true, and Spark refuses barrier stages under dynamic allocation "
            "(BarrierJobRunWithDynamicAllocationException): start the Connect server with "
            "spark.dynamicAllocation.enabled=false and a fixed spark.executor.instances")
    slots = task_slots(session)
    if slots is None or slots >= np // ranks_per_task:
        return
    master = conf(session, "spark.master")
    gpus = conf(session, "spark.task.resource.gpu.amount")
    per_task = f"spark.task.cpus={conf(session, 'spark.task.cpus') or 1}" + (
        f", spark.task.resource.gpu.amount={gpus}" if gpus else "")
    raise SlotsUnavailableError(
        f"{ranks_asked(np, ranks_per_task)} were asked for but the Spark Connect session's cluster ({master}) "
        f"can run only {slots} task(s) at once ({per_task}). A barrier stage needs every rank running together: "
        f"lower np/num_processes/num_proc to {max(slots, 1) * ranks_per_task} or less, or "
        "give the cluster more executors, cores or GPUs"
    )


def every_slot(session: ConnectSession) -> int:
    """The number of task slots, for "one rank per slot" (``num_proc=None``, ``np=0``).

    Raises:
        InvalidArgumentError: the session's settings do not give the number.
    """
    slots = task_slots(session)
    if slots is None or slots < 1:
        raise InvalidArgumentError(
            f"cannot count the task slots of this Spark Connect session's cluster "
            f"(spark.master={conf(session, 'spark.master')}): a Connect client has no SparkContext to ask; "
            "pass the number of ranks (np= / num_proc=)"
        )
    return slots


def client_host(session: ConnectSession, environ: dict[str, str] | None = None) -> str:
    """The address executors would reach this client at: ``PHALANX_CONNECT_CLIENT_HOST`` when set, else the
    local address of the route to the Connect server (its host as the session was given it)."""
    chosen = settings.CONNECT_CLIENT_HOST.get(environ)
    return chosen or _route_address(session) or socket.gethostname()


def client_bind_host(session: ConnectSession, advertise: str) -> str:
    """The address the client's log link listens on: ``advertise`` (what the cluster reaches the client at)
    when it is one of this machine's, else the local address of the route to the Connect server (an
    ``advertise`` behind NAT arrives there), never every interface."""
    if _is_local(advertise):
        return advertise
    return _route_address(session) or "127.0.0.1"


def _route_address(session: ConnectSession) -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(_server_host(session)), 9))  # a UDP "connect" sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _is_local(address: str) -> bool:
    try:
        with socket.create_server((address, 0)):
            return True
    except OSError:
        return False


def _server_host(session: ConnectSession) -> str:
    client = getattr(session, "client", None)
    host = getattr(client, "host", None) or getattr(getattr(client, "_builder", None), "host", None)
    return str(host or "localhost")


#: The Connect server's setting that makes it report query progress to the client (negative: off).
PROGRESS_INTERVAL_KEY = "spark.connect.progress.reportInterval"


def reports_progress(session: ConnectSession) -> bool:
    """True when the server reports query progress: Spark 4 servers do unless their setting is negative."""
    try:
        major = int(str(session.version).split(".")[0])
    except Exception:  # an unparsable version, or Connect's own error classes: tell nothing
        return False
    value = conf(session, PROGRESS_INTERVAL_KEY) or ""
    return major >= 4 and not value.strip().startswith("-")


class StageWatch:
    """Whether a query's stage started, told by Spark Connect's progress reports; a progress handler.

    Spark submits a barrier stage only once its slot check passes (else it retries the check for
    minutes), and the server reports a stage only once submitted, so a report with tasks means the
    stage got its slots. Reports of other queries are ignored: the client calls handlers on the thread
    that reads the query's results, so only reports on :attr:`thread_id` count. ``armed`` is False when
    the server does not report progress: then nothing can be told.
    """

    def __init__(self, session: ConnectSession) -> None:
        self.session = session
        self.armed = reports_progress(session)
        self.started = threading.Event()
        self.thread_id: int | None = None

    def __call__(self, stages: Iterable[StageInfo] | None, inflight_tasks: int, operation_id: str | None,
                 done: bool) -> None:
        """A progress report (pyspark's ``ProgressHandler`` interface)."""
        if threading.get_ident() == self.thread_id and any(stage.num_tasks > 0 for stage in stages or ()):
            self.started.set()

    def __enter__(self) -> StageWatch:
        if self.armed:
            # pyspark calls any callable of ProgressHandler's signature; subclassing its ABC would import
            # pyspark's Connect client with this module.
            self.session.registerProgressHandler(self)  # type: ignore[arg-type]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            self.session.removeProgressHandler(self)  # type: ignore[arg-type]
