"""``horovodrun`` and ``python -m horovod.runner.launch``: ``phalanxrun`` under Horovod's name.

The wheel installs a ``horovodrun`` console script beside ``phalanxrun``, so scripts, Makefiles and CI
that call ``horovodrun -np 2 python train.py`` run unchanged. As with the ``horovod`` imports, an installed
Horovod wins: when the real ``horovod`` package is importable (whichever wheel wrote ``bin/horovodrun``
last), this entry point hands the command line to Horovod's own ``horovod.runner.launch``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from phalanx.cli import main as phalanxrun
from phalanx.compat import _finder

PROG = "horovodrun"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``horovodrun``: Horovod's launcher where Horovod is installed, else ``phalanxrun``'s."""
    if _finder.real_package_exists("horovod"):
        _finder.uninstall()  # the real horovod.runner, not an alias of it
        sys.modules.pop("horovod", None)
        launch = importlib.import_module("horovod.runner.launch")
        if argv is not None:
            sys.argv[1:] = list(argv)
        launch.run_commandline()
        return 0
    return phalanxrun.main(argv, prog=PROG)


def run_commandline() -> None:
    """Horovod's name for the launcher's entry (``horovod.runner.launch.run_commandline``)."""
    sys.exit(main())


if __name__ == "__main__":
    run_commandline()
