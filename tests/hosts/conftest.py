"""Fixtures of the multi-host tier: two simulated hosts (tests/hosts/simhosts.py), skipped with the reason
where namespaces, root or sshd are not available."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.hosts.simhosts import Cluster, simulated_hosts, why_unavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two simulated hosts, ``hosta`` and ``hostb``, each running sshd; the driver runs on ``hosta``."""
    why = why_unavailable()
    if why:
        pytest.skip(why)
    with simulated_hosts(Path(__file__).resolve().parents[2], tmp_path_factory.mktemp("hosts")) as c:
        yield c


@pytest.fixture
def process_is_expected(cluster: Cluster) -> Callable[[int], bool]:
    """The hosts' sshd processes outlive every test; their per-connection children must not."""
    sshd = {h.sshd.pid for h in cluster.hosts.values()}
    return lambda pid: pid in sshd
