"""Horovod's logging knobs for the ``phalanx`` loggers of a rank (``hvd.init()`` applies them).

``HOROVOD_LOG_LEVEL`` (``TRACE``, ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``, ``FATAL``; ``phalanxrun
--log-level``) sets the level and ``HOROVOD_LOG_HIDE_TIME=1`` (``--log-without-timestamp``) drops the time
from each line. Either one installs a stderr handler on the ``phalanx`` logger with Horovod's layout,
``[2026-11-24 22:40:05.123456: W phalanx.torch._health.stall] message``, and stops propagation to the root logger
(so a line is not printed twice). Neither set: logging is left exactly as the application configured it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from phalanx.env import settings

#: Horovod's level names -> Python's (Python has no TRACE: it logs as DEBUG).
LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
          "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
_HANDLER_NAME = "phalanx-horovod-log"


def level_of(raw: str) -> int:
    """The logging level for a ``HOROVOD_LOG_LEVEL`` value (any case).

    Raises:
        ValueError: not one of Horovod's level names.
    """
    return LEVELS[settings.LOG_LEVEL.get({settings.LOG_LEVEL.name: raw})]


def configure(env: Mapping[str, str] | None = None) -> logging.Handler | None:
    """Apply ``HOROVOD_LOG_LEVEL`` / ``HOROVOD_LOG_HIDE_TIME`` to the ``phalanx`` logger (idempotent).

    Returns:
        The handler installed (or already there), or None when neither variable is set.

    Raises:
        ValueError: a level that is not one of Horovod's names.
    """
    env = os.environ if env is None else env
    raw_level = settings.LOG_LEVEL.get(env)
    hide_time = settings.LOG_HIDE_TIME.get(env)
    if not raw_level and not hide_time:
        return None
    logger = logging.getLogger("phalanx")
    logger.setLevel(level_of(raw_level) if raw_level else logging.WARNING)
    handler = next((h for h in logger.handlers if h.get_name() == _HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        logger.addHandler(handler)
    stamp = "" if hide_time else "%(asctime)s.%(msecs)03d000: "
    handler.setFormatter(logging.Formatter(f"[{stamp}%(levelname).1s %(name)s] %(message)s",
                                           datefmt="%Y-%m-%d %H:%M:%S"))
    logger.propagate = False
    return handler
