"""``horovod.common.util.env`` under the alias: set environment variables for the duration of a block.

Horovod's own tests (and some user scripts) use it to turn knobs on around ``hvd.init()``, e.g.
``with env(HOROVOD_TIMELINE=path, HOROVOD_TIMELINE_MARK_CYCLES="1"): hvd.init()``. It changes this
process's environment on purpose (that is its contract) and puts every variable back on exit.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set each ``NAME=value`` (None values are skipped) in ``os.environ`` inside the block, then restore
    the previous values (or remove the variables that were not set)."""
    values = {name: value for name, value in kwargs.items() if value is not None}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous
