"""tools/test_tiers.py: which pytest processes ``make test`` starts, and the status it ends with."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("test_tiers_tool", REPO / "tools" / "test_tiers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.chdir(REPO)
    return module


def fake_pytest(statuses: dict[str, int]) -> Callable[[list[str]], list[str]]:
    """A ``pytest()`` stand-in: a python that prints which tier it is and exits with that tier's status."""
    def command(args: list[str]) -> list[str]:
        tier = {"tests/hosts": "hosts", "tests/examples/test_examples_spark.py": "spark"}.get(args[0], "rest")
        return [sys.executable, "-I", "-S", "-c", f"print('tier={tier}', {args!r}); raise SystemExit({statuses[tier]})"]
    return command


def test_named_tests_run_in_one_pytest_and_options_alone_in_several(tiers: ModuleType) -> None:
    assert tiers.names_tests(["tests/unit", "-x"])
    assert tiers.names_tests(["tests/unit/test_layers.py::test_nothing", "-q"])
    assert not tiers.names_tests(["--durations=40", "-k", "shm and not hosts"])
    assert tiers.tier_args(tiers.HOSTS, ["--junitxml=/tmp/r.xml", "-x"]) == [
        "tests/hosts", "-p", "no:cacheprovider", "--junitxml=/tmp/r.xml.hosts.xml", "-x"]


def test_the_private_shm_is_a_tmpfs_with_the_machines_options(tiers: ModuleType) -> None:
    argv = tiers.in_private_shm(["pytest", "-x"])
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert f"mount -t tmpfs -o {tiers.shm_options()} tmpfs /dev/shm" in argv[7]
    assert argv[-2:] == ["pytest", "-x"]


@pytest.mark.parametrize(("private_shm", "rest", "hosts", "spark", "status"), [
    (True, 0, 0, 0, 0), (True, 2, 1, 0, 2), (True, 0, 1, 0, 1), (False, 0, 0, 3, 3), (False, 0, 5, 0, 0)])
def test_every_tier_runs_and_the_status_is_the_first_failing_ones(
        tiers: ModuleType, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], private_shm: bool,
        rest: int, hosts: int, spark: int, status: int) -> None:
    monkeypatch.setattr(tiers, "pytest", fake_pytest({"rest": rest, "hosts": hosts, "spark": spark}))
    monkeypatch.setattr(tiers, "can_make_private_shm", lambda: private_shm)
    monkeypatch.setattr(tiers, "in_private_shm", lambda argv: argv)
    assert tiers.main(["-q"]) == status
    out = capfd.readouterr().out
    order = [out.index(f"tier={name}") for name in ("rest", "hosts", "spark")]
    assert order == sorted(order), out  # the foreground's output first, then each tier's, whole
    assert "'--ignore', 'tests/hosts'" in out and "'--ignore', 'tests/spark'" in out
