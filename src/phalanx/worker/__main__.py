"""Entry point: ``python -m phalanx.worker``."""

from __future__ import annotations

from phalanx.worker.runtime import leave, main

if __name__ == "__main__":
    leave(main())
