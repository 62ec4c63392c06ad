"""Simulated hosts for the multi-host tier and bench/hosts.py.

Each host is a network namespace (10.99.0.x/24 on a bridge in a namespace of its own) with its own hostname
(UTS namespace), its own /dev/shm (a private tmpfs in a mount namespace), its own /etc/hosts naming every
test host, and an OpenSSH server that only this tier's key may log in to. Traffic stays between these
namespaces. Everything is removed at the end.

Needs root, ``ip netns``, ``unshare``, ``nsenter`` and Debian's ``openssh-server`` (installed here with
apt-get when missing); :func:`why_unavailable` says why when any of that is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# Namespace names carry this process's pid: concurrent runs (several worktrees on one machine) never meet,
# and a run sweeps only the namespaces of runs whose process is gone.
PREFIX = f"phx{os.getpid()}"
BRIDGE_NS = f"{PREFIX}-br"
SUBNET = "10.99.0"
HOSTS = ("hosta", "hostb")
# The most hosts one run may make: a leftover sweep must know every name a crashed run may have left.
MAX_HOSTS = 16
SSHD = "/usr/sbin/sshd"
SETUP_TIMEOUT_S = 300.0
HOST_KEY = Path("/var/tmp/phalanx-sim-hosts/host_key")


@dataclass
class SimHost:
    """One simulated host: its name, address, namespace and the pid of its sshd (a process inside it)."""

    name: str
    address: str
    netns: str
    sshd: subprocess.Popen[bytes]

    def pids(self) -> set[int]:
        """Every process in this host's network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False)
        return {int(p) for p in out.stdout.split()}

    def leftovers(self) -> set[int]:
        """Processes in the namespace other than its sshd (a job must leave none)."""
        return self.pids() - {self.sshd.pid}


@dataclass
class Cluster:
    """The simulated hosts and how to run a command on one of them (as if logged in there)."""

    hosts: dict[str, SimHost]
    key: Path
    workdir: Path
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def argv_on(self, host: str, argv: list[str], cwd: Path | None = None) -> list[str]:
        """``argv`` run inside ``host``'s network, UTS and mount namespaces, in ``cwd`` (the repository)."""
        pid = str(self.hosts[host].sshd.pid)
        return ["nsenter", "-t", pid, "-n", "-u", "-m", f"--wd={cwd or self.workdir}", "--", *argv]

    def run_on(self, host: str, argv: list[str], timeout: float, cwd: Path | None = None,
               **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to its end (output captured as text)."""
        return subprocess.run(self.argv_on(host, argv, cwd), capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or self.workdir, **kwargs)  # type: ignore[call-overload]

    def set_link(self, host: str, up: bool) -> None:
        """Cut ``host``'s link silently (its bridge port down: packets are dropped, no reset is sent) or
        restore it."""
        _sh("ip", "-n", BRIDGE_NS, "link", "set", f"v{host}", "up" if up else "down")

    def leftovers(self) -> dict[str, set[int]]:
        """Per host, the processes left besides its sshd."""
        return {name: h.leftovers() for name, h in self.hosts.items() if h.leftovers()}

    def wait_clean(self, timeout_s: float) -> None:
        """Wait until no host has processes besides its sshd; fail naming what is left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while left := self.leftovers():
            if time.monotonic() > deadline:
                raise AssertionError(f"processes left on the hosts {timeout_s:g} s after the job: {left}")
            time.sleep(0.1)


def _sh(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=60)


def why_unavailable() -> str | None:
    """None when simulated hosts can be made here (installing openssh-server if needed), else why not."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "simulated hosts need root on Linux (network, UTS and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r} on PATH"
    if not os.path.exists(SSHD):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "openssh-server"]):
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=SETUP_TIMEOUT_S, check=False)
            if done.returncode != 0:
                return f"openssh-server is not installed and {' '.join(argv)} failed: {done.stderr.strip()[-300:]}"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True, check=False)
    return None


def _stale_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split()
    out = []
    for name in listed:
        match = re.fullmatch(r"phx(\d+)-\w+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            out.append(name)
    return out


def host_names(count: int) -> tuple[str, ...]:
    """``hosta``, ``hostb``, ... (``count`` of them, at most :data:`MAX_HOSTS`)."""
    if not 1 <= count <= MAX_HOSTS:
        raise ValueError(f"simulated hosts: {count} hosts asked, 1 to {MAX_HOSTS} can be made")
    return tuple(f"host{chr(ord('a') + i)}" for i in range(count))


def _cleanup_namespaces() -> None:
    mine = [f"{PREFIX}-{h}" for h in host_names(MAX_HOSTS)]
    listed = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split())
    for ns in [BRIDGE_NS, *(n for n in mine if n in listed), *_stale_namespaces()]:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _network(names: tuple[str, ...], rate: str | None) -> None:
    _cleanup_namespaces()
    _sh("ip", "netns", "add", BRIDGE_NS)
    _sh("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
    _sh("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
    for i, host in enumerate(names):
        ns, peer = f"{PREFIX}-{host}", f"v{host}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", BRIDGE_NS, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "-n", BRIDGE_NS, "link", "set", peer, "master", "br0", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 2}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate is not None:
            set_link_rate(host, rate)


def set_link_rate(host: str, rate: str | None) -> None:
    """Limit ``host``'s link to ``rate`` in each direction (None: no limit): what it sends (its ``eth0``) and
    what it receives (its port on the bridge), a full-duplex link of that rate."""
    for netns, dev in ((f"{PREFIX}-{host}", "eth0"), (BRIDGE_NS, f"v{host}")):
        if rate is None:
            subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, check=False)  # fails harmlessly when there is none
        else:
            shape_link(netns, dev, rate)


def shape_link(netns: str, dev: str, rate: str) -> None:
    """Limit what ``dev`` (in ``netns``) sends to ``rate`` (tc's units: ``1gbit``, ``10gbit``) with a token
    bucket, so that the link between two simulated hosts is slower than memory, as between real machines.
    (This kernel has no netem: no delay is added; a LAN's ~0.1 ms matters little next to the rate.)

    The bucket holds 1 ms of traffic, and never less than the largest segment veth hands over (64 KiB with
    GSO), which tbf drops rather than delays when it exceeds the bucket."""
    bits = _rate_bits(rate)
    burst = max(bits // 8 // 1000, 256 << 10)
    _sh("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
        "burst", str(burst), "latency", "50ms")


def _rate_bits(rate: str) -> int:
    """``1gbit`` -> 10**9 (tc's decimal bit units: kbit, mbit, gbit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    if m is None:
        raise ValueError(f"simulated hosts: link rate {rate!r} is not like '1gbit', '10gbit' or '500mbit'")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def _sshd_config(d: Path, host: str, address: str) -> Path:
    cfg = d / f"sshd_{host}.conf"
    cfg.write_text(
        f"ListenAddress {address}\nPort 22\nHostKey {d / 'host_key'}\nPidFile none\n"
        f"PermitRootLogin prohibit-password\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\nUseDNS no\nMaxStartups 100\nMaxSessions 100\n"
    )
    return cfg


def _start_host(d: Path, host: str, address: str, etc_hosts: Path) -> SimHost:
    cfg = _sshd_config(d, host, address)
    script = (f"hostname {host} && mount -t tmpfs -o size=1g tmpfs /dev/shm && "
              f"mount --bind {etc_hosts} /etc/hosts && mkdir -p /run/sshd && exec {SSHD} -D -e -f {cfg}")
    proc = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-{host}", "unshare", "--uts", "--mount",
                             "--propagation", "private", "sh", "-c", script],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(d / f"sshd_{host}.log", "wb"))
    return SimHost(host, address, f"{PREFIX}-{host}", proc)


def _wait_ssh(cluster: Cluster, host: str) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        done = cluster.run_on(host, ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                                     "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                                     "-i", str(cluster.key), host, "true"], timeout=30)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {host} did not answer within 30 s: {done.stderr}")
        time.sleep(0.2)


@contextmanager
def simulated_hosts(workdir: Path, keydir: Path, names: tuple[str, ...] = HOSTS,
                    rate: str | None = None) -> Iterator[Cluster]:
    """Start the hosts ``names`` (``hosta`` and ``hostb`` unless told; :func:`host_names` makes more), sshd
    in each, their links limited to ``rate`` in each direction when given (:func:`shape_link`); remove every
    namespace and process at the end.

    Call :func:`why_unavailable` first.
    """
    d = keydir
    # One host key per machine, kept between runs: the launcher's ssh records it in known_hosts.
    if not HOST_KEY.exists():
        HOST_KEY.parent.mkdir(parents=True, exist_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(HOST_KEY))
    shutil.copy(HOST_KEY, d / "host_key")
    os.chmod(d / "host_key", 0o600)
    if not (d / "id").exists():
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id"))
    shutil.copy(d / "id.pub", d / "authorized_keys")
    etc_hosts = d / "etc_hosts"
    addresses = {host: f"{SUBNET}.{i + 2}" for i, host in enumerate(names)}
    etc_hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in addresses.items()))
    _network(names, rate)
    hosts: dict[str, SimHost] = {}
    try:
        for host, address in addresses.items():
            hosts[host] = _start_host(d, host, address, etc_hosts)
        c = Cluster(hosts, d / "id", workdir)
        for host in hosts:
            _wait_ssh(c, host)
        yield c
    finally:
        for h in hosts.values():
            h.sshd.kill()
            h.sshd.wait()
        _cleanup_namespaces()
