"""The driver's side of the host agents: start one (over ssh, or as a child here), read it, judge its end.

Shared by the hosts launcher (one agent per host) and the elastic hosts launcher (one agent per worker, so
a worker can be added or retired on its own). Each agent runs its ranks with
:class:`~phalanx.launch.supervisor.RankSupervisor`; their exits arrive as the supervisors' EVENT frames
(:class:`~phalanx.launch.supervisor.ExitReports`). An agent that ends before its ranks reported (ssh
refused or dropped, the interpreter missing) is reported here, with its host and its last lines.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.env.contract import nic_env
from phalanx.job.channel import Custom, DriverChannel
from phalanx.job.records import ErrorRecord
from phalanx.job.shipping import collect_modules, script_of
from phalanx.launch.core import DRAIN_WAIT_S
from phalanx.launch.host_agent import AgentPlan
from phalanx.launch.ssh import SshOptions, agent_command, interface_address, route_address, ssh_argv
from phalanx.launch.supervisor import HEARTBEAT, HEARTBEAT_S, ExitReports

log = logging.getLogger(__name__)

#: Prefixes of the driver's variables every rank gets (horovodrun forwards these too).
FORWARDED_PREFIXES = ("HOROVOD_", "NCCL_", "PHALANX_")
#: Variables forwarded by name.
FORWARDED_NAMES = (env_names.PYTHONPATH,)
#: Seconds an agent that ended cleanly may take for its ranks' exit reports to be read.
REPORT_WAIT_S = 30.0
#: ssh's exit code when it could not connect or lost the connection (also: the remote command was killed).
SSH_LOST = 255
#: How much earlier than the driver heard of it an agent's death counts, when its ranks were running: the
#: survivors' errors about the lost ranks reach the driver first, within this margin.
HOST_LOSS_LEAD_S = 2.0
#: Seconds without a heartbeat (:data:`~phalanx.launch.supervisor.HEARTBEAT`) after which a host whose ranks
#: run is taken as silent (a cut link sends no reset, and ssh alone would wait for good); a user's gloo
#: timeout shortens it (:func:`silence_limit`), so the host is named before the survivors' collectives time out.
HOST_SILENCE_S = 30.0
_SILENCE_FLOOR_S = 3.0
_WATCH_S = 0.5
_AGENT_TAIL_LINES = 20


def forwarded_env(environ: dict[str, str] | os._Environ[str], extra: dict[str, str]) -> dict[str, str]:
    """The variables every rank gets from the driver: ``HOROVOD_*``, ``NCCL_*``, ``PHALANX_*``,
    ``PYTHONPATH``, then the user's ``extra`` (which wins)."""
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}
    return {**env, **extra}


def plan_env(environ: dict[str, str] | os._Environ[str], forward: dict[str, str], interfaces: tuple[str, ...],
             user: dict[str, str]) -> dict[str, str]:
    """The variables of an agent's ranks: the forwarded ones (:func:`forwarded_env`), then
    ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` naming ``interfaces`` (``--network-interfaces``: over an
    inherited value, under one the user gave for the ranks), then the user's job variables."""
    given = {**forward, **user}
    return {**forwarded_env(environ, forward), **nic_env(interfaces, given), **user}


def script_modules(command: tuple[str, ...] | None) -> dict[str, str]:
    """A script job's shipped modules for the agents of other hosts: every ``*.py`` beside the script (the
    script included), relative path -> base64 source; empty for a function job or a missing script."""
    script = script_of(command or ())
    if script is None or not os.path.isfile(script):
        return {}
    files = collect_modules(Path(script).resolve().parent, imported=False)
    return {rel: base64.b64encode(data).decode("ascii") for rel, data in files.items()}


def silence_limit(env: Mapping[str, str]) -> float:
    """How long a host may send no heartbeat: :data:`HOST_SILENCE_S`, or three quarters of the ranks'
    ``HOROVOD_GLOO_TIMEOUT_SECONDS`` when that is shorter (never under 3 s)."""
    gloo = settings.GLOO_TIMEOUT.get(env)
    return HOST_SILENCE_S if gloo is None else max(_SILENCE_FLOOR_S, min(HOST_SILENCE_S, 0.75 * gloo))


def driver_address(interfaces: tuple[str, ...], remote: list[str]) -> str:
    """Where the channel and the store listen: the first ``--network-interfaces`` NIC's address, else this
    machine's address on the route to the first remote host, else loopback."""
    if interfaces:
        return interface_address(interfaces[0])
    return route_address(remote[0]) if remote else "127.0.0.1"


class AgentGroup:
    """The agents of one job.

    Args:
        python: the agents' (and ranks') interpreter.
        ssh: how to reach the remote hosts.
        local: the hosts that are this machine (their agents are children, no ssh).
        exits: the job's exit reports (the agents' ranks end there).
        on_lost: called with the host (in a watcher thread, before the missing exits are posted) when an
            agent's ssh could not connect or lost the connection.
    """

    def __init__(self, python: str, ssh: SshOptions, local: set[str], exits: ExitReports,
                 on_lost: Callable[[str], None] | None = None, silence_s: float = HOST_SILENCE_S) -> None:
        self.python = python
        self.ssh = ssh
        self.local = local
        self.exits = exits
        self.on_lost = on_lost
        self.procs: list[subprocess.Popen[bytes]] = []
        self.threads: list[threading.Thread] = []
        self._tails: dict[int, deque[str]] = {}
        self._quiet: set[int] = set()
        self._channel: DriverChannel | None = None
        self._stopping = threading.Event()
        self.silence_s = silence_s
        self._running: dict[int, tuple[str, subprocess.Popen[bytes], tuple[int, ...]]] = {}  # pid -> agent
        self._beats: dict[int, float] = {}  # rank -> time.monotonic() of its supervisor's last heartbeat
        self._watcher = threading.Thread(target=self._watch, name="phalanx-heartbeats", daemon=True)

    def attach(self, channel: DriverChannel) -> None:
        """The job's channel (aborted on stop; agents' failures are posted on its queue)."""
        self._channel = channel
        self.exits.attach(channel)
        self._watcher.start()

    def argv(self, host: str) -> list[str]:
        """The agent's command line for ``host``."""
        if host in self.local:
            return [self.python, "-m", "phalanx.launch.host_agent"]
        return ssh_argv(host, self.ssh, agent_command(self.python, os.getcwd()))

    def start(self, host: str, plan: AgentPlan) -> subprocess.Popen[bytes]:
        """Start an agent on ``host`` and write ``plan`` (with the secret) to its stdin; watch it."""
        assert self._channel is not None
        proc = subprocess.Popen(self.argv(host), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        assert proc.stdin is not None
        self.procs.append(proc)
        self._running[proc.pid] = (host, proc, plan.ranks)
        self._tails[proc.pid] = deque(maxlen=_AGENT_TAIL_LINES)
        try:
            proc.stdin.write(plan.encode())
            proc.stdin.flush()
        except OSError:
            pass  # the agent is gone already: its watcher reports why
        reader = threading.Thread(target=self._read, args=(host, proc), daemon=True)
        waiter = threading.Thread(target=self._await, args=(host, proc, plan.ranks, reader), daemon=True)
        reader.start()
        waiter.start()
        self.threads.extend((reader, waiter))
        return proc

    def retire(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop one agent's ranks (its stdin ends); their ends are reported as usual, without an error."""
        self._quiet.add(proc.pid)
        _close_stdin(proc)

    def on_custom(self, event: Custom, ranks: int) -> None:
        """Route a supervisor's EVENT frame (a heartbeat, an exit report) of a rank below ``ranks``."""
        if event.body == HEARTBEAT:
            self._beats[event.rank] = time.monotonic()
        elif event.rank < ranks:
            self.exits.on_event(event)

    def _watch(self) -> None:
        """Name a host whose agent's heartbeats stopped while its ranks ran (until every agent ended)."""
        while True:
            time.sleep(_WATCH_S)
            agents = list(self._running.values())
            if not agents and self._stopping.is_set():
                return
            for host, proc, ranks in agents:
                last = max((self._beats.get(r, 0.0) for r in ranks), default=0.0)
                if last and time.monotonic() - last > self.silence_s and not self.exits.reported(ranks):
                    self._silent(host, proc, ranks, last)

    def _silent(self, host: str, proc: subprocess.Popen[bytes], ranks: tuple[int, ...], last: float) -> None:
        """A host went silent: it is lost (the root cause, dated when its heartbeats stopped)."""
        self._running.pop(proc.pid, None)
        if self.on_lost is not None and host not in self.local:
            self.on_lost(host)
        missing = [r for r in ranks if not self.exits.reported([r])]
        if missing and proc.pid not in self._quiet and self._channel is not None:
            self._channel.events.put(ErrorRecord(
                rank=missing[0], exc_type="phalanx.errors.PhalanxError",
                message=f"host {host} went silent: no heartbeat from its agent for {time.monotonic() - last:.0f} s "
                        f"(the limit: {self.silence_s:g} s; a link down or the host frozen), so its rank(s) "
                        f"{missing} are taken as lost",
                traceback="", at=last + HEARTBEAT_S))
            for rank in missing:
                self.exits.post(rank, 1)
        proc.kill()  # its ssh would wait for the link for good

    def _read(self, host: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tails[proc.pid].append(line)
            log.warning("host %s: %s", host, line)

    def _await(self, host: str, proc: subprocess.Popen[bytes], ranks: tuple[int, ...],
               reader: threading.Thread) -> None:
        returncode = proc.wait()
        ended_at = time.monotonic()
        self._running.pop(proc.pid, None)
        running = self._ranks_ran(ranks)
        # ssh's 255 after the ranks ran is a session that ended without an exit status: the agent was killed
        # (an agent the launcher stops ends with its own status); it stays the cause even if survivors' errors
        # about its lost ranks have already made the launcher stop the job.
        killed = returncode == SSH_LOST and running
        quiet = proc.pid in self._quiet or (self._stopping.is_set() and not killed)
        reader.join(DRAIN_WAIT_S)
        if returncode == SSH_LOST and host not in self.local and not quiet and self.on_lost is not None:
            self.on_lost(host)
        deadline = time.monotonic() + (REPORT_WAIT_S if returncode == 0 else DRAIN_WAIT_S)
        while time.monotonic() < deadline and not self.exits.reported(ranks) and not self._stopping.is_set():
            time.sleep(0.05)
        missing = [r for r in ranks if not self.exits.reported([r])]
        if missing and not quiet:
            assert self._channel is not None
            # The driver hears of a dead agent after the survivors' errors about its lost ranks (ssh's end,
            # the drain above): a death while its ranks ran is dated back so that it is the root cause.
            at = ended_at - HOST_LOSS_LEAD_S if running else ended_at
            self._channel.events.put(ErrorRecord(
                rank=missing[0], exc_type="phalanx.errors.PhalanxError",
                message=self._death(host, returncode, running, missing, self._tails[proc.pid]), traceback="",
                at=at))
        for rank in missing:
            self.exits.post(rank, returncode or 1)

    def _ranks_ran(self, ranks: tuple[int, ...]) -> bool:
        """Whether any of an agent's ranks reached the channel (then ssh had connected: its 255 means the
        session ended without an exit status, the agent or its host killed)."""
        return self._channel is not None and any(self._channel.ever_connected(r) for r in ranks)

    @staticmethod
    def _death(host: str, returncode: int, running: bool, missing: list[int], tail: deque[str]) -> str:
        """Why an agent ended before its ranks reported: the cause on the first line (the agent's last line
        when it said why), then its last lines."""
        if running:
            how = (f"the agent on host {host} died while its ranks ran (exit code {returncode}: it was killed, "
                   "or the host went down or off the network)")
        elif returncode == SSH_LOST:
            how = f"ssh to host {host} could not connect or lost the connection (exit code {returncode})"
        else:
            how = f"the agent on host {host} ended (exit code {returncode})"
        last = next((line.strip() for line in reversed(tail) if line.strip()), "")
        lines = "\n".join(tail) or "(no output)"
        cause = f"{how}: {last}" if last else how
        return f"{cause}; rank(s) {missing} never reported their end. Its last lines:\n{lines}"

    def stop(self, grace_s: float) -> None:
        """Stop every agent's ranks: ABORT on the channel, every stdin closed; wait for the agents up to
        ``grace_s`` plus the drain wait (the launcher's teardown kills what is left)."""
        self._stopping.set()
        if self._channel is not None:
            self._channel.abort_all()
        for proc in list(self.procs):
            _close_stdin(proc)
        deadline = time.monotonic() + grace_s + DRAIN_WAIT_S
        for proc in list(self.procs):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
