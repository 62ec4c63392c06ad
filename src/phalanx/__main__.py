"""``python -m phalanx``: the ``phalanx`` command (``run``, ``timeline``, ``doctor``)."""

from __future__ import annotations

import sys

from phalanx.cli.tool import main

if __name__ == "__main__":
    sys.exit(main())
