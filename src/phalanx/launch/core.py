"""What every launcher shares: the run id, how a rank's process starts, how the monitor judges a job.

The local launcher (ranks are children of the driver), the Spark launcher (ranks are children of barrier
tasks) and the hosts launcher (ranks are children of an agent started over ssh) differ only in *where*
ranks start; the pieces below are the same for all three, so a rank starts, drains and is judged the same
way wherever it runs.
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
from typing import Any

from phalanx.env import names as env_names
from phalanx.job.monitor import MonitorConfig
from phalanx.launch import warm
from phalanx.launch.warm import RankProcess

log = logging.getLogger(__name__)

#: Seconds a rank's output pipes and channel may stay open after its process ended (a grandchild that
#: inherited the pipe keeps it open) before the rank is judged on what arrived.
DRAIN_WAIT_S = 5.0
#: Seconds the monitor waits, beyond the teardown grace and the drain, for stopped ranks to report.
STOP_SLACK_S = 2.0


def new_run_id() -> str:
    """A fresh job id (``PHALANX_RUN_ID``, ``TORCHELASTIC_RUN_ID``; also marks the job's processes)."""
    return f"phalanx-{uuid.uuid4().hex[:12]}"


def start_timeout_hint(knob: str | None) -> str:
    """How a start-timeout error names the way to raise it: the entry point's own knob, if it has one,
    and ``HOROVOD_START_TIMEOUT``, which every entry point reads.

    Args:
        knob: the argument or flag of the entry point (``"start_timeout="``, ``"--start-timeout"``), or
            None when the entry point has none.
    """
    variable = f"the {env_names.HOROVOD_START_TIMEOUT} variable"
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


def spawn_rank(argv: Sequence[str], env: dict[str, str], template: warm.Template | None = None,
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
