"""What every launcher shares: the job's spec, the run id, how a rank's process starts, how the monitor
judges a job.

The local launcher (ranks are children of the driver), the Spark launcher (ranks are children of barrier
tasks) and the hosts launcher (ranks are children of an agent started over ssh) differ only in *where*
ranks start (:mod:`phalanx.launch.driver`); the pieces below are the same for all three, so a job is
described, and a rank starts, drains and is judged, the same way wherever it runs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from phalanx.env import names as env_names
from phalanx.env.contract import teardown_grace_s
from phalanx.job.monitor import MonitorConfig
from phalanx.launch import warm
from phalanx.launch.warm import RankProcess
from phalanx.observe import ObserveOptions
from phalanx.observe import resolve as resolve_observe

log = logging.getLogger(__name__)

#: Seconds a rank's output pipes and channel may stay open after its process ended (a grandchild that
#: inherited the pipe keeps it open) before the rank is judged on what arrived.
DRAIN_WAIT_S = 5.0
#: Seconds the monitor waits, beyond the teardown grace and the drain, for stopped ranks to report.
STOP_SLACK_S = 2.0


@dataclass(frozen=True)
class JobSpec:
    """One job, wherever its ranks run; validated by the public entry points before construction.

    The job:

    Attributes:
        np: number of ranks.
        payload: the serialized call of a function job; empty for a command job.
        command: the command each rank runs (on Spark: ``(script, *args)`` run with the executor's python);
            None for a function job.
        env: the user's extra variables for every rank (the contract wins on conflicts).
        start_timeout_s: seconds every rank has to reach the channel.
        start_timeout_hint: the knob to name in a start-timeout error.
        teardown_grace_s: seconds between SIGTERM and SIGKILL on teardown.
        warm_preload: for function jobs, the modules a warm-start template should import; None turns
            warm starts off for this job.
        observe: the job's live page and MLflow logging on the driver (docs/observe.md); None: neither
            (default: ``PHALANX_DASHBOARD`` / ``PHALANX_MLFLOW``, so every entry point honours them).

    The driver's output (``prefix``, ``prefix_timestamp`` and ``output_dir`` for a job whose ranks are the
    driver's: local, hosts):

    Attributes:
        progress: say on ``stderr`` what the start waits for (the warm-start template, the host agents, the
            barrier tasks, the ranks started); False: ``phalanxrun -q``, ``phalanx.run(quiet=True)``,
            ``phalanx.spark.run(verbose=0)``.
        prefix: prefix each output line with ``[rank]<stream>:``.
        prefix_timestamp: start each output line with the local time (horovodrun's
            ``--prefix-output-with-timestamp``).
        output_dir: also keep each rank's output under this directory.

    A Spark job's tasks and its output on the driver:

    Attributes:
        use_gpu: give each rank its task's GPUs.
        ranks_per_task: ranks each barrier task runs, one per GPU of the task
            (``spark.task.resource.gpu.amount`` when it is above 1); ``np`` is a multiple of it
            (:func:`phalanx.spark.gpus.ranks_per_task`).
        console: ``"all"`` prints every rank's output on the driver; ``"log_callback_only"`` prints only
            ``log_to_driver`` messages and keeps the full logs in files.
        stdout: where rank output goes on the driver (default: ``sys.stdout`` at the time of writing).
        stderr: where rank error output goes on the driver (default: ``sys.stderr``).
        description: shown in the Spark UI.
    """

    np: int
    payload: bytes = b""
    command: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 30.0
    start_timeout_hint: str = "start_timeout"
    teardown_grace_s: float = field(default_factory=teardown_grace_s)
    warm_preload: tuple[str, ...] | None = None
    observe: ObserveOptions | None = field(default_factory=resolve_observe)
    progress: bool = True
    prefix: bool = True
    prefix_timestamp: bool = False
    output_dir: str | None = None
    use_gpu: bool = False
    ranks_per_task: int = 1
    console: str = "all"
    stdout: IO[str] | None = None
    stderr: IO[str] | None = None
    description: str = "phalanx job"

    @property
    def tasks(self) -> int:
        """Barrier tasks of a Spark job (``np / ranks_per_task``)."""
        return self.np // self.ranks_per_task


def new_run_id() -> str:
    """A fresh job id (``PHALANX_RUN_ID``, ``TORCHELASTIC_RUN_ID``; also marks the job's processes)."""
    return f"phalanx-{uuid.uuid4().hex[:12]}"


def start_timeout_hint(knob: str | None, spark: bool = False) -> str:
    """How a start-timeout error names the way to raise it: the entry point's own knob, if it has one,
    and the variable it reads (``HOROVOD_SPARK_START_TIMEOUT`` on Spark, else ``HOROVOD_START_TIMEOUT``).

    Args:
        knob: the argument or flag of the entry point (``"start_timeout="``, ``"--start-timeout"``), or
            None when the entry point has none.
        spark: the entry point runs its ranks on Spark.
    """
    name = env_names.HOROVOD_SPARK_START_TIMEOUT if spark else env_names.HOROVOD_START_TIMEOUT
    variable = f"the {name} variable"
    return f"{knob} (or {variable})" if knob else variable


def monitor_config(np: int, function_job: bool, start_timeout_s: float, hint: str,
                   teardown_grace_s: float) -> MonitorConfig:
    """The monitor's settings for a job of ``np`` ranks (a function job expects a hello and a result)."""
    return MonitorConfig(
        world_size=np,
        expect_results=function_job,
        expect_hello=function_job,
        start_timeout_s=start_timeout_s,
        start_timeout_hint=hint,
        stop_wait_s=teardown_grace_s + DRAIN_WAIT_S + STOP_SLACK_S,
        teardown_grace_s=teardown_grace_s,
    )


def worker_argv(command: Sequence[str] | None, python: str = sys.executable) -> list[str]:
    """The argv of a rank's process: the function-job worker, or the command wrapped by the exec worker."""
    if command is None:
        return [python, "-m", "phalanx.worker"]
    return [python, "-m", "phalanx.worker.exec", *command]


_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def python_command(command: Sequence[str], path: str | None,
                   executable: str = sys.executable) -> dict[str, Any] | None:
    """How a warm-start template runs ``command`` (``phalanx.worker.pyrun``), or None when it cannot: only
    ``python SCRIPT ARGS`` and ``python -m MODULE ARGS`` (``-u`` allowed: ranks are unbuffered anyway) where
    ``python`` (found on ``path``) is this interpreter of this environment: the same file in the same
    directory (another virtual environment's ``python`` links to the same file from elsewhere)."""
    if len(command) < 2 or not _PYTHON_NAME.fullmatch(os.path.basename(command[0])):
        return None
    found = command[0] if os.sep in command[0] else shutil.which(command[0], path=path)
    if found is None or not _same_interpreter(found, executable):
        return None
    rest = list(command[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m" and _MODULE_NAME.fullmatch(rest[1]):
        return {"kind": "module", "target": rest[1], "args": rest[2:], "argv": list(command)}
    if rest and not rest[0].startswith("-"):
        return {"kind": "path", "target": rest[0], "args": rest[1:], "argv": list(command)}
    return None


def _same_interpreter(found: str, executable: str) -> bool:
    here, there = os.path.abspath(found), os.path.abspath(executable)
    try:
        return os.path.dirname(here) == os.path.dirname(there) and os.path.samefile(here, there)
    except OSError:
        return False


def spawn_rank(argv: Sequence[str], env: dict[str, str], template: warm.TemplateLink | None = None,
               cwd: str | None = None, python: dict[str, Any] | None = None) -> RankProcess:
    """Start one rank: forked from a warm-start template when one is given and answers (a command job
    only with ``python``, see :func:`python_command`), else a fresh process in its own session with
    stdout/stderr on pipes.

    The worker sets ``PR_SET_PDEATHSIG`` itself, which follows the *thread* that started it: call this
    from a thread that lives as long as the job (the launcher's main thread).
    """
    if template is not None:
        try:
            return template.spawn(env, cwd or os.getcwd(), python)
        except OSError as e:
            log.debug("warm start failed, starting cold: %s", e)
    return subprocess.Popen(
        list(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
    )
