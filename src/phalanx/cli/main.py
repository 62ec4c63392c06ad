"""``phalanxrun``: run a command as N ranks on this machine; every horovodrun flag parses.

Parse (core flags here, the rest of horovodrun's in ``cli/flags.py``; ``--config-file`` in
``cli/config_file.py``) -> :class:`RunConfig` (frozen, validated) -> :class:`LocalLauncher`. The exit code is the
root-cause rank's exit code (a signal N gives 128 + N).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from phalanx.cli import build_info, config_file, flags
from phalanx.env import names as env_names
from phalanx.errors import InvalidArgumentError, PhalanxError, WorkerFailedError
from phalanx.job.shipping import script_of
from phalanx.launch.api import (
    discovered_hosts,
    elastic_spec,
    hosts_spec,
    resolve_hosts,
    resolve_start_timeout,
    slots_per_host_unused,
    validate_np,
    validate_slots_per_host,
)
from phalanx.launch.core import JobSpec, start_timeout_hint
from phalanx.launch.elastic_hosts import ElasticHostsLauncher
from phalanx.launch.elasticity import ElasticLocalLauncher, ElasticSpec
from phalanx.launch.local import LocalLauncher
from phalanx.launch.remote import HostsLauncher, HostsSpec
from phalanx.observe import ObserveOptions
from phalanx.observe import resolve as resolve_observe

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class RunConfig:
    """A validated ``phalanxrun`` invocation."""

    np: int
    command: tuple[str, ...]
    start_timeout_s: float
    output_dir: str | None
    prefix: bool
    verbose: bool
    timeline: str | None
    timeline_mark_cycles: bool
    elastic: ElasticSpec | None = None
    knobs: tuple[tuple[str, str], ...] = ()
    prefix_timestamp: bool = False
    warnings: tuple[str, ...] = ()
    hosts: HostsSpec | None = None
    check_hosts_only: bool = False
    forward_env: tuple[tuple[str, str], ...] = ()
    observe: ObserveOptions | None = None
    quiet: bool = False

    def job_env(self) -> dict[str, str]:
        """Variables the command's ranks get on top of the contract: ``-x``'s (on every host, as mpirun
        exports them), then the timeline and the flags' knobs (an explicit flag wins over ``-x``)."""
        env = {**dict(self.forward_env), **dict(self.knobs)}
        if self.timeline:
            env[env_names.HOROVOD_TIMELINE] = os.path.abspath(self.timeline)
            if self.timeline_mark_cycles:
                env[env_names.HOROVOD_TIMELINE_MARK_CYCLES] = "1"
        return env

    def to_spec(self) -> JobSpec:
        """The launcher's job description."""
        return JobSpec(
            np=self.np,
            command=self.command,
            env=self.job_env(),
            start_timeout_s=self.start_timeout_s,
            start_timeout_hint=start_timeout_hint("--start-timeout"),
            prefix=self.prefix,
            prefix_timestamp=self.prefix_timestamp,
            output_dir=self.output_dir,
            observe=self.observe,
            progress=not self.quiet,
        )


class _CheckBuild(argparse.Action):
    """``-cb/--check-build``: print what phalanx supports here and exit (``-np`` is then not needed)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        sys.stdout.write(build_info.report(build_info.probe()))
        parser.exit(0)


_EXAMPLES = """\
Run COMMAND as N ranks with the phalanx/Horovod/torchrun contract, on this machine or over ssh.

examples:
  {prog} -np 4 python train.py                        4 ranks on this machine
  {prog} -np 8 -H node1:4,node2:4 python train.py     8 ranks on two hosts, over ssh
  {prog} -np 8 --hostfile hosts.txt python train.py   hosts from a file of 'host slots=N' lines
  {prog} -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py
                                                          elastic: 2 to 8 ranks as hosts come and go
  {prog} -np 2 --timeline-filename tl.json python train.py
                                                          a Horovod timeline (phalanx timeline summarize tl.json)
"""


class _Parser(argparse.ArgumentParser):
    """Prints a bad command line's error in one line, with a pointer to ``--help`` (not the usage)."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with ``PROG: error: MESSAGE`` and the hint."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the flags and "
                              "examples.\n")


def build_parser(prog: str = "phalanxrun") -> argparse.ArgumentParser:
    """The argument parser: every horovodrun flag (``cli/flags.py`` holds those beyond the core ones)."""
    p = _Parser(
        prog=prog,
        usage="%(prog)s -np N [flags] COMMAND [ARGS...]",
        description=_EXAMPLES.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--version", action="version", version=build_info.version_text())
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("-cb", "--check-build", action=_CheckBuild, nargs=0,
                   help="show which frameworks and operations phalanx supports here, and exit")
    p.add_argument("--config-file", default=None,
                   help="horovodrun's YAML file of parameters; flags on the command line win over it")
    p.add_argument("-H", "--hosts", default=None,
                   help="host:slots,host:slots; each host's slots are filled in turn (other hosts over ssh)")
    p.add_argument("--python", default=None,
                   help="the interpreter of the ranks on every host (default: this one's path)")
    p.add_argument("-x", "--env", dest="forward_env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a variable for every rank on every host (NAME alone: this environment's value)")
    p.add_argument("--check-hosts", action="store_true",
                   help="check that every host answers over ssh and imports phalanx, then exit")
    p.add_argument("--start-timeout", type=float, default=None,
                   help="seconds for all ranks to start (default: HOROVOD_START_TIMEOUT or 30)")
    p.add_argument("--output-filename", default=None,
                   help="also keep each rank's output in DIR/rank.N/{stdout,stderr}")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]<stream>:")
    p.add_argument("--timeline-filename", default=None, help="write a Horovod timeline to this file")
    p.add_argument("--dashboard", nargs="?", const="1", default=None, metavar="[HOST:]PORT",
                   help="serve the job's live page and /metrics (default: a free port on 127.0.0.1); the address "
                        "is printed once (docs/observe.md)")
    p.add_argument("--mlflow", action="store_const", const=True, default=None,
                   help="log the job's metrics and timeline summary to MLflow (a run must be active: "
                        "MLFLOW_RUN_ID)")
    p.add_argument("--timeline-mark-cycles", action="store_const", const=True, default=None,
                   help="mark cycles in the timeline")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=None,
                   help="elastic: fewest ranks the job may go on with (makes the job elastic; docs/elastic.md)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=None,
                   help="elastic: most ranks (default: -np)")
    p.add_argument("--reset-limit", type=int, default=None,
                   help="elastic: most re-formations of the world before the job fails (default: no limit)")
    p.add_argument("--host-discovery-script", default=None,
                   help="elastic: executable printing host:slots lines, polled every second; the world grows "
                        "up to --max-np when this machine's slots grow (only this host's names count)")
    p.add_argument("--verbose", action="store_true", help="log what the launcher does")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="do not say what the start waits for (the 'phalanx: ranks started k/N' progress on stderr)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    flags.add_flags(p)
    return p


def _check_command(command: Sequence[str], np: int, prog: str) -> None:
    if not command:
        raise InvalidArgumentError(f"no command given: {prog} -np {np} python train.py")
    exe = command[0]
    rest = " ".join(command[1:])
    if shutil.which(exe) is None:
        if not os.path.isfile(exe):
            raise InvalidArgumentError(f"command {exe!r} was not found on PATH or as a file")
        # A file that exec cannot start: not executable, or a bare name that exec looks up on PATH only.
        if exe.endswith(".py") or not os.access(exe, os.X_OK):
            raise InvalidArgumentError(f"{exe!r} is a file, not a command: run it with its interpreter, "
                                       f"{prog} -np {np} python {exe} {rest}".rstrip())
        raise InvalidArgumentError(f"{exe!r} is not on PATH: give its path, {prog} -np {np} ./{exe} {rest}".rstrip())
    script = script_of(command)
    if script and not os.path.isfile(script):
        raise InvalidArgumentError(f"script {script!r} does not exist (working directory: {os.getcwd()})")


def _writable_dir(path: str) -> bool:
    """Whether ``path`` is a directory this user can write, or could be created as one."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK)


def _check_output_paths(output_dir: str | None, timeline: str | None) -> None:
    """``--output-filename``'s directory and the timeline's must be writable, before any rank starts."""
    if output_dir and not _writable_dir(output_dir):
        raise InvalidArgumentError(f"--output-filename {output_dir!r}: cannot create or write that directory; "
                                   "give a directory you can write")
    if timeline and (os.path.isdir(timeline) or not _writable_dir(os.path.dirname(os.path.abspath(timeline)))):
        raise InvalidArgumentError(f"--timeline-filename {timeline!r}: cannot write a file there; give a file "
                                   "path in a directory you can write")


_PORT_SPEC = re.compile(r"(\[[0-9a-fA-F:.]+\]:|[\w.-]+:)?\d+")


def _dashboard_value(argv: list[str]) -> list[str]:
    """``--dashboard`` takes a value only when the next word is ``[HOST:]PORT``: in ``--dashboard python
    train.py`` the command is not the page's address."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == "--":
            break
        if word == "--dashboard" and not _PORT_SPEC.fullmatch(out[i + 1]):
            out[i] = "--dashboard=1"
    return out


def parse_config(argv: Sequence[str], prog: str = "phalanxrun") -> RunConfig:
    """Parse and validate the command line.

    Raises:
        InvalidArgumentError: a bad value (the message says which and why).
    """
    ns = build_parser(prog).parse_args(_dashboard_value(list(argv)))
    if ns.config_file:
        config_file.apply(ns, ns.config_file)
    flags.validate(ns)
    np = validate_np(ns.np, "-np")
    slots = validate_slots_per_host(ns.slots, "--slots-per-host")
    forward = _forward_env(ns.forward_env)
    hosts = _hosts_spec(ns, np, forward, slots)
    command = tuple(ns.command[1:] if ns.command[:1] == ["--"] else ns.command)
    if not ns.check_hosts:
        _check_command(command, np, prog)
        _check_output_paths(ns.output_filename, ns.timeline_filename)
    knobs = flags.knob_env(ns)
    return RunConfig(
        np=np,
        command=command,
        start_timeout_s=resolve_start_timeout(ns.start_timeout),
        output_dir=ns.output_filename,
        prefix=not ns.no_prefix,
        verbose=ns.verbose,
        timeline=ns.timeline_filename,
        timeline_mark_cycles=bool(ns.timeline_mark_cycles),
        elastic=elastic_spec(np, ns.min_np, ns.max_np, ns.reset_limit, knobs,
                             discovery_script=ns.host_discovery_script, slots_per_host=slots),
        knobs=tuple(sorted(knobs.items())),
        prefix_timestamp=bool(ns.prefix_output_with_timestamp),
        warnings=tuple(flags.noop_warnings(ns) + _local_host_warnings(ns, hosts, slots)),
        hosts=hosts,
        check_hosts_only=bool(ns.check_hosts),
        forward_env=tuple(sorted(forward.items())),
        observe=resolve_observe(ns.dashboard, ns.mlflow),
        quiet=bool(ns.quiet),
    )


def _forward_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise InvalidArgumentError(f"-x/--env {item!r}: give NAME or NAME=VALUE")
        if not sep and name not in os.environ:
            raise InvalidArgumentError(f"-x/--env {name}: not set in this environment; give {name}=VALUE")
        env[name] = value if sep else os.environ[name]
    return env


def _hosts_spec(ns: argparse.Namespace, np: int, forward: dict[str, str], slots: int | None) -> HostsSpec | None:
    """The multi-host part of the job, or None when every host is this machine."""
    remote = resolve_hosts(ns.hosts, np, ns.hostfile, slots)
    if remote is None and ns.hosts is None and ns.hostfile is None and ns.host_discovery_script:
        remote = discovered_hosts(ns.host_discovery_script, slots)  # as horovodrun: ranks go to the discovered hosts
    if remote is None:
        return None
    nics = ns.nics or ns.nic
    return hosts_spec(remote, ns.ssh_port, ns.ssh_identity_file, nics, resolve_start_timeout(ns.start_timeout),
                      ns.python, forward)


def _local_host_warnings(ns: argparse.Namespace, hosts: HostsSpec | None, slots: int | None) -> list[str]:
    unused = slots_per_host_unused(slots, any(v is not None for v in (ns.hosts, ns.hostfile, ns.host_discovery_script)))
    if hosts is not None:
        return []
    if unused is not None:
        return [unused]
    given = [name for name, value in (("--ssh-port", ns.ssh_port), ("--ssh-identity-file", ns.ssh_identity_file),
                                      ("--network-interfaces", ns.nics or ns.nic)) if value is not None]
    return [f"{name} changes nothing: every host is this machine (no ssh; loopback and shared memory)"
            for name in given]


def _launch(config: RunConfig) -> None:
    spec = config.to_spec()
    if config.hosts is not None:
        if config.elastic is not None and not config.check_hosts_only:
            ElasticHostsLauncher(spec, config.elastic, config.hosts).run()
            return
        launcher = HostsLauncher(spec, config.hosts)
        if config.check_hosts_only:
            launcher.check()
            sys.stdout.write("phalanxrun: every host answered and imports phalanx\n")
            return
        launcher.run()
        return
    if config.check_hosts_only:
        sys.stdout.write("phalanxrun: every host is this machine; nothing to check over ssh\n")
        return
    (ElasticLocalLauncher(spec, config.elastic) if config.elastic else LocalLauncher(spec)).run()


def main(argv: Sequence[str] | None = None, prog: str = "phalanxrun") -> int:
    """Run ``phalanxrun`` (or ``horovodrun``: ``prog``); returns the process exit code."""
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, prog)
    except InvalidArgumentError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return EXIT_USAGE
    for warning in config.warnings:
        sys.stderr.write(f"{prog}: warning: {warning}\n")
    logging.basicConfig(level=logging.DEBUG if config.verbose else logging.WARNING,
                        format=f"{prog}: %(message)s")
    try:
        _launch(config)
    except WorkerFailedError as e:
        sys.stderr.write(f"{prog}: {e}\n")
        return e.exit_code
    except PhalanxError as e:
        sys.stderr.write(f"{prog}: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted; all ranks were stopped\n")
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
