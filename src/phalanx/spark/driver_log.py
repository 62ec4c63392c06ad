"""``log_to_driver``: a message from a rank to the driver's console (``sparkdl.horovod.log_to_driver``)."""

from __future__ import annotations

import json
import sys

from phalanx.env import settings
from phalanx.errors import ChannelError
from phalanx.job.framing import Kind


def log_to_driver(message: object) -> None:
    """Show ``message`` on the driver's console, prefixed with this rank.

    In a Spark job the message travels on the job's authenticated channel, so it shows even with
    ``driver_log_verbosity="log_callback_only"``. Elsewhere (``HorovodRunner(np<0)``, ``phalanx.run``, a
    plain script) it is written to this process's stdout, which the local launcher streams.

    Args:
        message: any object; its ``str()`` is sent.
    """
    from phalanx.worker import current_channel

    channel = current_channel()
    if channel is not None and settings.LOG_TO_DRIVER.get():
        try:
            channel.send(Kind.EVENT, json.dumps({"log": str(message)}).encode())
            return
        except ChannelError:
            pass
    sys.stdout.write(f"{message}\n")
    sys.stdout.flush()


def rank_log_dir(run_id: str) -> str:
    """A new directory for every rank's full output under ``driver_log_verbosity="log_callback_only"``,
    announced on the driver: HorovodRunner's documented default shows only :func:`log_to_driver`, so the
    user is told where the ranks' ``print()`` and logging went (one ``phalanx`` warning)."""
    import logging
    import tempfile

    path = tempfile.mkdtemp(prefix=f"{run_id}-logs-")
    logging.getLogger("phalanx").warning(
        "phalanx: driver_log_verbosity='log_callback_only': the ranks' print() and logging go to "
        "%s/rank.N/{stdout,stderr} (driver_log_verbosity='all' shows them here)", path)
    return path
