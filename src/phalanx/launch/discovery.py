"""Host discovery for elastic local jobs (Horovod's ``--host-discovery-script``).

The script prints one ``host:slots`` line per available host (a line ``host`` alone has ``--slots-per-host``
slots, else one: horovodrun's rule). The driver runs it every
``DISCOVERY_INTERVAL_S`` seconds; when the slots change it tells the monitor, which grows the world up to
``max_np`` (a new round; running ranks get ``HostsUpdatedInterrupt`` at their next ``commit()``). A local
job runs on this machine only, so only this host's names count there (:func:`local_slots`: ``localhost``,
``127.0.0.1``, its hostname; a line naming another host is ignored, with a warning); a job across hosts
(``-H``) takes every listed host.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable

from phalanx.errors import InvalidArgumentError

log = logging.getLogger(__name__)

#: Seconds between two runs of the discovery script.
DISCOVERY_INTERVAL_S = 1.0
#: Seconds one run of the script may take before it is killed (and its output ignored).
DISCOVERY_TIMEOUT_S = 10.0


def local_names() -> set[str]:
    """The names under which a discovery script may list this machine."""
    return {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}


def parse_hosts(text: str, default_slots: int = 1) -> dict[str, int]:
    """Parse ``host:slots`` lines (blank lines and ``#`` comments skipped; a bare ``host`` has
    ``default_slots``: horovodrun's ``--slots-per-host``, else one).

    Raises:
        ValueError: a line whose slot count is not a non-negative integer.
    """
    hosts: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.rpartition(":") if ":" in line else (line, "", str(default_slots))
        if not slots.strip().isdigit():
            raise InvalidArgumentError(f"host discovery line {raw!r} is not host:slots")
        hosts[host.strip()] = hosts.get(host.strip(), 0) + int(slots)
    return hosts


def check_script(script: object) -> str:
    """Validate a discovery script path before anything starts.

    Raises:
        InvalidArgumentError: not a path to an executable file.
    """
    if not isinstance(script, str | os.PathLike) or not os.path.isfile(script):
        raise InvalidArgumentError(f"host discovery script {script!r} is not a file")
    if not os.access(script, os.X_OK):
        raise InvalidArgumentError(f"host discovery script {os.fspath(script)!r} is not executable; chmod +x it")
    return os.path.abspath(script)


def local_slots(hosts: dict[str, int], warned: set[str]) -> int:
    """This machine's slots among the discovered ``hosts``; other hosts are ignored, each with one warning
    (``warned`` holds the hosts warned about already)."""
    names = local_names()
    for host in sorted(set(hosts) - names - warned):
        log.warning("host discovery listed %r: local elastic jobs run on this machine only "
                    "(localhost, 127.0.0.1, %s); its slots are ignored", host, socket.gethostname())
        warned.add(host)
    return sum(slots for host, slots in hosts.items() if host in names)


class HostDiscovery:
    """Runs the script in a background thread and reports the hosts and their slots when they change.

    Args:
        script: the executable that prints ``host:slots`` lines.
        on_change: called (in the discovery thread) with the new ``host -> slots``.
        interval_s: seconds between runs.
        default_slots: the slots of a line that names a host alone (``--slots-per-host``).
    """

    def __init__(self, script: str, on_change: Callable[[dict[str, int]], None],
                 interval_s: float = DISCOVERY_INTERVAL_S, default_slots: int = 1) -> None:
        self.script = script
        self.default_slots = default_slots
        self.on_change = on_change
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._hosts: dict[str, int] | None = None
        self._thread = threading.Thread(target=self._loop, name="phalanx-discovery", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (waits for a running script at most its timeout)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(DISCOVERY_TIMEOUT_S + 1.0)

    def poll(self) -> dict[str, int] | None:
        """Run the script once; return ``host -> slots``, or None when the run failed."""
        try:
            done = subprocess.run([self.script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("host discovery script %s failed: %s", self.script, e)
            return None
        if done.returncode != 0:
            log.warning("host discovery script %s exited with %d: %s", self.script, done.returncode,
                        done.stderr.strip()[:200])
            return None
        try:
            return parse_hosts(done.stdout, self.default_slots)
        except ValueError as e:
            log.warning("%s", e)
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            hosts = self.poll()
            if hosts is not None and hosts != self._hosts:
                self._hosts = hosts
                self.on_change(hosts)
            self._stop.wait(self.interval_s)
