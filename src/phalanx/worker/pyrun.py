"""Run a rank's ``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` in a process forked from the warm-start
template, as the interpreter would have run it, so that a command job's ranks skip interpreter start-up and
torch's import too (:mod:`phalanx.worker.template`).

The launcher decides that a command qualifies (``phalanx.launch.core.python_command``: this very
interpreter, no option but ``-u``); the forked child then checks that nothing that an interpreter reads
only at start-up differs between the job's environment and the one the template started with (``PYTHON*``
variables, the locale, the dynamic loader's and the math libraries' variables, torch's import-time ones).
If something does, the child replaces itself with the command (``execvp``), exactly as a cold rank starts;
otherwise it runs the script or module as ``__main__`` with the interpreter's ``sys.argv`` and
``sys.path[0]``, prints an uncaught exception's traceback from the user's first frame, and ends as the
interpreter ends (non-daemon threads joined, atexit hooks run, exit code of ``sys.exit``, 1 after an
uncaught exception, SIGINT after an uncaught ``KeyboardInterrupt``).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from collections.abc import Mapping
from typing import Any

from phalanx.worker.exec import EXIT_NOT_FOUND
from phalanx.worker.lifeline import die_with_parent

#: Variables read when an interpreter (or a library the template imported) starts, not later: a job whose
#: value differs from the template's starts the command fresh instead.
STARTUP_PREFIXES = ("PYTHON", "LC_", "LANG", "LD_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_")
#: torch's own variables read when it is imported (the others, NCCL's and the flight recorder's, are read
#: when a process group is made, in the rank).
TORCH_AT_IMPORT = frozenset({"TORCH_CPP_LOG_LEVEL", "TORCH_LOGS", "TORCH_SHOW_CPP_STACKTRACES",
                             "TORCH_DISABLE_ADDR2LINE"})
#: Set per rank by the contract and applied after the fork (``template._apply_thread_count``), or read at
#: run time only.
AFTER_FORK = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONBREAKPOINT"})


def startup_differs(template_env: Mapping[str, str], job_env: Mapping[str, str]) -> list[str]:
    """The start-up variables whose values differ between the template's environment and the job's."""
    keys = {k for k in (*template_env, *job_env)
            if (k.startswith(STARTUP_PREFIXES) or k in TORCH_AT_IMPORT) and k not in AFTER_FORK}
    return sorted(k for k in keys if template_env.get(k) != job_env.get(k))


def run(spec: Mapping[str, Any], template_env: Mapping[str, str]) -> int:
    """Run the command ``spec["argv"]`` (``spec``: ``{"kind": "path" | "module", "target": ..., "args": [...],
    "argv": [...]}``) in this forked process; returns only when exec'ing the command instead failed (the
    process otherwise ends as the interpreter would)."""
    die_with_parent()
    if startup_differs(template_env, os.environ):
        return _exec([str(a) for a in spec["argv"]])
    _start_up_hooks()
    from phalanx.worker.runtime import leave

    try:
        _run_main(spec)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        _print_traceback(e)
        leave(130, killed_by=signal.SIGINT)
    except BaseException as e:
        _print_traceback(e)
        code = 1
    leave(code)


def _start_up_hooks() -> None:
    """What the wheel's ``.pth`` start-up hooks (``_phalanx_startup``) do in a rank's fresh interpreter: they
    ran in the template, outside any job, where the rank-only ones stay off; and the template imported
    ``torch.distributed`` already, so what ``PhalanxShmNativeHook`` does on that import is done now (the
    ``phalanx_shm`` substitution, DeepSpeed's op building wrapped). Nothing where the hooks are not
    installed (a cold rank would have none either)."""
    startup = sys.modules.get("_phalanx_startup")
    if startup is None:
        return
    startup.install_lightning_hook()
    from phalanx.worker import deepspeed_ops, dist_backend

    deepspeed_ops.install()
    dist_backend.install()


def _exec(argv: list[str]) -> int:
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"phalanx: cannot run {argv[0]!r}: {e.strerror}\n")
    return EXIT_NOT_FOUND


def _run_main(spec: Mapping[str, Any]) -> None:
    """As ``python SCRIPT`` / ``python -m MODULE`` set up ``sys.argv`` and ``sys.path[0]`` (the script's
    directory, symbolic links resolved / the working directory) and run it as ``__main__``."""
    target, args = str(spec["target"]), [str(a) for a in spec["args"]]
    if spec["kind"] == "module":
        sys.argv = [target, *args]  # run_module puts the module's file in sys.argv[0], as -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    runpy.run_path(target, run_name="__main__")


def _exit_code(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``: None 0, an int itself, anything else printed
    to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def _print_traceback(e: BaseException) -> None:
    """The interpreter's report of an uncaught exception (through ``sys.excepthook``), from the user's first
    frame (runpy's and this module's are left out, as a cold ``python SCRIPT`` has none)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in ("runpy", __name__):
        tb = tb.tb_next
    # The interpreter's own call: torch's hook, set once a process group exists, names the rank.
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    sys.stderr.flush()
