"""The host agent: ``python -m phalanx.launch.host_agent``, started by the hosts launcher (over ssh, or as a
child on the driver's own machine) to run one host's ranks.

It reads its plan as one JSON line on stdin — the job's secret travels there, never on a command line,
where ``ps`` on the host would show it — then supervises each of the host's ranks as a Spark task does
(:class:`~phalanx.launch.supervisor.RankSupervisor`: one channel connection per rank, output forwarded,
exit reported). Stdin stays open for the job's life: its end (the driver died, ssh dropped, the driver
stopped the job) stops every rank's process tree and ends the agent. Ranks die with the agent too
(their parent-death signal), and with the driver's channel (the supervisor's abort watch).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from phalanx.env import JobContract, assign_ranks, compose_env, settings, worker_env
from phalanx.env import names as env_names
from phalanx.errors import ChannelError, InvalidArgumentError, PhalanxError
from phalanx.job.channel import Role, WorkerChannel
from phalanx.job.framing import Kind
from phalanx.job.records import ErrorRecord
from phalanx.job.shipping import script_of, write_modules
from phalanx.launch import warm
from phalanx.launch.core import DRAIN_WAIT_S, python_command, worker_argv
from phalanx.launch.supervisor import EXIT_NOT_STARTED, RankSupervisor, exit_event

#: Most bytes of the plan line (the forwarded variables and a script job's shipped modules, base64).
MAX_PLAN_BYTES = 64 << 20


@dataclass(frozen=True)
class AgentPlan:
    """What one host's agent runs.

    Attributes:
        job: where the job meets (channel, store, secret).
        hosts: the host of every rank, in rank order (local and cross ranks follow from it).
        ranks: the ranks this agent runs.
        command: the command each rank runs, or None for a function job.
        env: the user's variables forwarded from the driver.
        cwd: the working directory of the ranks.
        python: the interpreter of the ranks.
        teardown_grace_s: seconds between SIGTERM and SIGKILL when the job stops.
        over: variables laid over the contract (an elastic worker's id and round timeout).
        modules: driver-local module files shipped with a script job (relative path -> base64 source;
            :mod:`phalanx.job.shipping`): written to a private directory first on the ranks'
            ``PYTHONPATH``; the script runs from there when it does not exist on this host.
    """

    job: JobContract
    hosts: tuple[str, ...]
    ranks: tuple[int, ...]
    command: tuple[str, ...] | None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."
    python: str = sys.executable
    teardown_grace_s: float = 3.0
    over: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        """One JSON line (the plan's only wire form)."""
        body: dict[str, Any] = {
            "job": self.job.__dict__, "hosts": list(self.hosts), "ranks": list(self.ranks),
            "command": None if self.command is None else list(self.command), "env": self.env,
            "cwd": self.cwd, "python": self.python, "teardown_grace_s": self.teardown_grace_s, "over": self.over,
            "modules": self.modules,
        }
        return json.dumps(body).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> AgentPlan:
        """Parse and type-check a plan line.

        Raises:
            InvalidArgumentError: not a plan (the field is named).
        """
        try:
            raw = json.loads(line)
            job = JobContract(**{k: raw["job"][k] for k in JobContract.__dataclass_fields__ if k in raw["job"]})
            plan = cls(job=job, hosts=tuple(raw["hosts"]), ranks=tuple(raw["ranks"]),
                       command=None if raw["command"] is None else tuple(raw["command"]), env=dict(raw["env"]),
                       cwd=raw["cwd"], python=raw["python"], teardown_grace_s=float(raw["teardown_grace_s"]),
                       over=dict(raw.get("over", {})), modules=dict(raw.get("modules", {})))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"the agent's plan on stdin is malformed: {type(e).__name__}: {e}") from e
        _check_types(plan)
        return plan


def _check_types(plan: AgentPlan) -> None:
    strings = [*plan.hosts, *(plan.command or ()), *plan.env, *plan.env.values(), *plan.over, *plan.over.values(),
               *plan.modules, *plan.modules.values(), plan.cwd, plan.python]
    if not all(isinstance(s, str) for s in strings) or not all(isinstance(r, int) for r in plan.ranks):
        raise InvalidArgumentError("the agent's plan has a non-string name or a non-integer rank")
    if any(not 0 <= r < len(plan.hosts) for r in plan.ranks):
        raise InvalidArgumentError(f"the agent's plan names ranks {plan.ranks} outside 0..{len(plan.hosts) - 1}")


class Agent:
    """Runs one host's ranks to their end (see the module docstring)."""

    def __init__(self, plan: AgentPlan) -> None:
        self.plan = plan
        self._supervisors: list[RankSupervisor] = []
        self._lock = threading.Lock()
        self.modules_dir: str | None = None
        self._command = plan.command
        self._pythonpath: dict[str, str] = {}
        if plan.modules:
            self._install_modules()

    def _install_modules(self) -> None:
        files = {rel: base64.b64decode(data) for rel, data in self.plan.modules.items()}
        self.modules_dir = tempfile.mkdtemp(prefix="phalanx-modules-")
        write_modules(files, self.modules_dir)
        inherited = self.plan.env.get(env_names.PYTHONPATH, os.environ.get(env_names.PYTHONPATH, ""))
        self._pythonpath = {env_names.PYTHONPATH: os.pathsep.join(p for p in (self.modules_dir, inherited) if p)}
        script = script_of(self.plan.command or ())
        if self.plan.command and script and not os.path.isfile(os.path.join(self.plan.cwd, script)):
            shipped = os.path.join(self.modules_dir, os.path.basename(script))
            if os.path.isfile(shipped):
                self._command = tuple(shipped if arg == script else arg for arg in self.plan.command)

    def remove_modules(self) -> None:
        """Remove the shipped modules' directory (the ranks have ended)."""
        if self.modules_dir is not None:
            shutil.rmtree(self.modules_dir, ignore_errors=True)

    def run(self) -> int:
        """Supervise every rank in a thread of its own; return 0 once all ended (their exits went to the
        driver)."""
        template = self._template()
        threads = [threading.Thread(target=self._rank, args=(r, template), name=f"phalanx-rank-{r}")
                   for r in self.plan.ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 0

    def stop(self) -> None:
        """Stop every rank's process tree (SIGTERM, grace, SIGKILL)."""
        with self._lock:
            supervisors = list(self._supervisors)
        for s in supervisors:
            s.stop()

    def _env(self, rank: int) -> dict[str, str]:
        who = assign_ranks(self.plan.hosts)[rank]
        own = {env_names.PHALANX_PARENT_PID: str(os.getpid()), **self._pythonpath, **self.plan.over}
        return compose_env(os.environ, self.plan.env, {**worker_env(self.plan.job, who), **own}, os.cpu_count())

    def _template(self) -> warm.Template | None:
        """A warm-start template for this host's ranks, when it runs several of a function job or of a
        ``python SCRIPT`` command: one import of torch on the host instead of one per rank. Started in the
        ranks' environment (shipped modules on ``PYTHONPATH`` included) so a command's start-up variables
        match it (``phalanx.worker.pyrun``). None with ``PHALANX_WARM_START=0`` among the forwarded variables."""
        if len(self.plan.ranks) < 2 or (self._command is not None and self._python_run() is None):
            return None
        base = {**os.environ, **self.plan.env, **self._pythonpath}
        if not settings.WARM_START.get(base):
            return None
        return warm.template_for_job((), warm.job_wait_s(self.plan.job.start_timeout_s), base)

    def _python_run(self) -> dict[str, Any] | None:
        return None if self._command is None else python_command(self._command, os.environ.get("PATH"))

    def _rank(self, rank: int, template: warm.Template | None = None) -> None:
        job = self.plan.job
        try:
            channel = WorkerChannel.connect(job.channel, job.secret, rank, Role.SUPERVISOR, job.start_timeout_s)
        except ChannelError as e:
            sys.stderr.write(f"phalanx agent: rank {rank} cannot reach the driver: {e}\n")
            return
        supervisor = RankSupervisor(channel, rank, self.plan.teardown_grace_s, heartbeat=True)
        with self._lock:
            self._supervisors.append(supervisor)
        try:
            argv = worker_argv(self._command, self.plan.python)
            returncode = supervisor.run(argv, self._env(rank), template, self.plan.cwd, self._python_run())
        except (PhalanxError, OSError) as e:
            supervisor.send(Kind.ERROR, ErrorRecord.from_exception(rank, e).encode())
            returncode = EXIT_NOT_STARTED
        supervisor.send(Kind.EVENT, exit_event(returncode, supervisor.ended_at))
        channel.close()


def _watch_stdin(agent: Agent) -> None:
    # The driver never writes after the plan: EOF (or an error) means it is gone or wants these ranks stopped.
    # The ranks' threads then report their ends (a driver still listening counts them) and the agent ends;
    # if that takes longer than the teardown, it ends anyway.
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    agent.stop()
    time.sleep(agent.plan.teardown_grace_s + DRAIN_WAIT_S)
    agent.remove_modules()
    os._exit(0)


def main() -> int:
    """Entry point: read the plan, run the ranks, end when they end or stdin closes."""
    try:
        plan = AgentPlan.decode(sys.stdin.buffer.readline(MAX_PLAN_BYTES))
    except InvalidArgumentError as e:
        sys.stderr.write(f"phalanx agent: {e}\n")
        return 2
    try:
        agent = Agent(plan)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"phalanx agent: cannot write the shipped modules: {e}\n")
        return 2
    threading.Thread(target=_watch_stdin, args=(agent,), name="phalanx-stdin", daemon=True).start()
    try:
        return agent.run()
    finally:
        agent.remove_modules()


if __name__ == "__main__":
    CODE = main()
    # The stdin watcher (a daemon thread) may hold stdin's lock in a blocking read: a normal interpreter
    # shutdown would then abort with "could not acquire lock for <stdin>"; the ranks have ended, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CODE)
