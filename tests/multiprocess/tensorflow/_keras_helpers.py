"""Helpers the test ranks import (tests/ is not a package: the test passes this directory on PYTHONPATH)."""

from __future__ import annotations

import hashlib
from typing import Any


def weights_agree(hvd: Any, model: Any) -> bool:
    """Whether every rank holds bit-identical weights (an allgather of a hash of each rank's weight bytes)."""
    import numpy as np

    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).digest()
    mine = np.frombuffer(digest, dtype=np.int64).reshape(1, -1)
    every = np.asarray(hvd.allgather(mine, name="weights digest"))
    return bool((every == every[0]).all())
