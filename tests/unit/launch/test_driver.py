"""The job driver's contract with its rank starter: start once, stop on a failure, close once after the verdict."""

from __future__ import annotations

import pytest

from phalanx.env import JobContract
from phalanx.errors import WorkerFailedError
from phalanx.job.channel import DriverChannel
from phalanx.job.monitor import RankExit
from phalanx.launch.core import JobSpec
from phalanx.launch.driver import DriverAddress, JobDriver


class ScriptedStarter:
    """Ends its ranks with the given exit codes as soon as they are started; records the driver's calls."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.calls: list[str] = []
        self.job: JobContract | None = None

    def start(self, job: JobContract, channel: DriverChannel) -> None:
        self.calls.append("start")
        self.job = job
        for rank, code in enumerate(self.codes):
            channel.events.put(RankExit(rank=rank, returncode=code))

    def stop(self, grace_s: float) -> None:
        self.calls.append(f"stop {grace_s:g}")

    def unfinished(self) -> list[int]:
        return []

    def close(self) -> None:
        self.calls.append("close")


def _driver(starter: ScriptedStarter, **kwargs: object) -> JobDriver:
    spec = JobSpec(np=len(starter.codes), command=("true",), teardown_grace_s=4.0, observe=None)
    return JobDriver(spec, starter, DriverAddress.loopback(), [], run_id="phalanx-test", **kwargs)  # type: ignore[arg-type]


def test_a_job_that_ends_well_is_closed_once_and_not_stopped() -> None:
    starter = ScriptedStarter([0, 0])
    assert _driver(starter).run() == [None, None]
    assert starter.calls == ["start", "close"]
    assert starter.job is not None and starter.job.run_id == "phalanx-test" and starter.job.master_addr == "127.0.0.1"


def test_a_failed_rank_stops_the_starter_with_the_teardown_grace_then_the_reaping_grace() -> None:
    starter = ScriptedStarter([0, 3])
    with pytest.raises(WorkerFailedError, match="rank 1"):
        _driver(starter, stop_reaps_s=0.5).run()
    # The monitor stops the ranks on the failure, then the driver reaps what is left, then closes the starter.
    assert starter.calls[0] == "start" and starter.calls[-2:] == ["stop 0.5", "close"]
    assert "stop 4" in starter.calls[1:-2]
