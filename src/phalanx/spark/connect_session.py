"""What a Spark Connect session can tell phalanx: whether it is one, its settings, its task slots, and
the address its executors would reach this client at.

A Connect client has no SparkContext: no ``maxNumConcurrentTasks``, no executor list, no driver-side
``pythonExec``. The task slots are counted from the server's settings instead (``spark.master``,
``spark.executor.instances``, ``spark.executor.cores``, ``spark.task.cpus``), which is exact for
``local[N]`` and ``local-cluster`` masters and for a static cluster once its executors joined; when the
settings do not say (``local[*]``, dynamic allocation), the stage is submitted and Spark's own barrier
check applies (docs/spark.md, "Spark Connect").
"""

from __future__ import annotations

import re
import socket
from typing import Any

from phalanx.env import settings
from phalanx.errors import InvalidArgumentError, SlotsUnavailableError

_LOCAL = re.compile(r"local(?:\[(\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[(\d+),\s*(\d+),\s*\d+\]$")


def is_connect(session: object) -> bool:
    """True when ``session`` is a Spark Connect ``SparkSession``."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def active_connect_session() -> Any | None:
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
    session = SparkSession.getActiveSession() or getattr(SparkSession, "_default_session", None)
    if session is None or getattr(session, "is_stopped", False):
        return None
    return session if is_connect(session) else None


def conf(session: Any, key: str) -> str | None:
    """A setting of the session (``spark.conf.get``), or None when it is unset or the server hides it."""
    try:
        value = session.conf.get(key, None)
    except Exception:  # the server refuses some keys (and errors are Connect's own classes)
        return None
    return None if value is None else str(value)


def task_slots(session: Any) -> int | None:
    """Tasks the session's cluster runs at once, from its settings; None when the settings do not say."""
    master = conf(session, "spark.master") or ""
    per_task = int(float(conf(session, "spark.task.cpus") or 1))
    local, cluster = _LOCAL.match(master), _LOCAL_CLUSTER.match(master)
    if local is not None:
        cores = 1 if master == "local" else int(local.group(1)) if local.group(1) else None
    elif cluster is not None:
        cores = int(cluster.group(1)) * int(cluster.group(2))
    else:
        cores = _static_cluster_cores(session)
    return None if cores is None else cores // max(per_task, 1)


def _static_cluster_cores(session: Any) -> int | None:
    if (conf(session, "spark.dynamicAllocation.enabled") or "false").lower() == "true":
        return None
    instances, cores = conf(session, "spark.executor.instances"), conf(session, "spark.executor.cores")
    if instances is None or cores is None:
        return None
    return int(instances) * int(cores)


def check_slots(session: Any, np: int) -> None:
    """Refuse a job the session's cluster cannot run at once, when its settings say so.

    Raises:
        SlotsUnavailableError: fewer slots than ``np`` (the message has the values and what to change).
    """
    slots = task_slots(session)
    if slots is None or slots >= np:
        return
    master = conf(session, "spark.master")
    raise SlotsUnavailableError(
        f"{np} ranks were asked for but the Spark Connect session's cluster ({master}) can run only {slots} "
        f"task(s) at once (spark.task.cpus={conf(session, 'spark.task.cpus') or 1}). A barrier stage needs every "
        f"rank running together: lower np/num_processes/num_proc to {max(slots, 1)} or less, or give the "
        "cluster more executors or cores"
    )


def every_slot(session: Any) -> int:
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


def client_host(session: Any, environ: dict[str, str] | None = None) -> str:
    """The address executors would reach this client at: ``PHALANX_CONNECT_CLIENT_HOST`` when set, else the
    local address of the route to the Connect server (its host as the session was given it)."""
    chosen = settings.CONNECT_CLIENT_HOST.get(environ)
    if chosen:
        return chosen
    server = _server_host(session)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(server), 9))  # a UDP "connect" sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _server_host(session: Any) -> str:
    client = getattr(session, "client", None)
    host = getattr(client, "host", None) or getattr(getattr(client, "_builder", None), "host", None)
    return str(host or "localhost")
