"""Entry point: ``python -m phalanx.worker``."""

from __future__ import annotations

import sys

from phalanx.worker.runtime import main

if __name__ == "__main__":
    sys.exit(main())
