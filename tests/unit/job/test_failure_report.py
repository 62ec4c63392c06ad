"""Reading a rank's traceback as the user's: their file and line, phalanx's frames folded (job/report.py),
and a function pickled by value keeping its file name (job/payload.py)."""

from __future__ import annotations

import traceback
from typing import Any

import cloudpickle
import pytest

from phalanx.errors import WorkerFailedError
from phalanx.job import report
from phalanx.job.payload import dumps

PHX = report.PHALANX_DIR
TRACEBACK = f"""Traceback (most recent call last):
  File "{PHX}job/shipping.py", line 152, in run_with_modules
    return call.fn(*call.args, **call.kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/home/u/train.py", line 7, in train
    step(batch)
  File "/home/u/train.py", line 3, in step
    hvd.allreduce(x)
  File "{PHX}torch/mpi_ops.py", line 170, in allreduce
    handle = async_ops.allreduce_async(compressed)
  File "{PHX}transport/_control.py", line 203, in _fail
    raise ShmTransportError(
phalanx.errors.ShmTransportError: peer rank 1 has died
"""


def test_user_frame_and_folded_phalanx_frames() -> None:
    lines = TRACEBACK.splitlines()
    assert report.user_frame(report.frames(lines)) == report.Frame("/home/u/train.py", 3, "step")
    text, hidden = report.trim(TRACEBACK)
    assert hidden == 2  # shipping's and mpi_ops'; the innermost frame stays: it says where it was raised
    assert text.splitlines()[:3] == ["Traceback (most recent call last):", "  [1 frame in phalanx]",
                                     '  File "/home/u/train.py", line 7, in train']
    assert "[1 frame in phalanx]" in text.splitlines()[6] and "_control.py" in text and "shipping" not in text


def test_a_command_ranks_traceback_is_found_behind_its_prefix() -> None:
    output = ["epoch 1", *(f"[rank1]: {ln}" for ln in TRACEBACK.splitlines()), "[rank1]: "]
    found = report.read_failure("", output)
    assert found.where == "/home/u/train.py:3 in step" and found.from_output
    assert found.exception == "phalanx.errors.ShmTransportError: peer rank 1 has died"
    assert report.read_failure("", ["no traceback here"]) == report.FoundFailure()


def test_a_function_pickled_by_value_keeps_its_file_and_lines() -> None:
    source = "def train(x):\n    y = x + 1\n    raise ValueError(f'bad {y}')\n"
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, "/home/u/notebook_cell.py", "exec"), scope)
    assert "<dynamic-code>" in str(cloudpickle.dumps(scope["train"]))  # what cloudpickle alone ships
    train = cloudpickle.loads(dumps(scope["train"]))
    assert train.__code__.co_filename == "/home/u/notebook_cell.py"
    with pytest.raises(ValueError) as info:
        train(1)
    last = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (last.filename, last.lineno, last.name) == ("/home/u/notebook_cell.py", 3, "train")


def test_entry_point_reports_ctrl_c_in_one_line_and_hides_the_launchers_frames(
        capsys: pytest.CaptureFixture[str]) -> None:
    from phalanx.errors import RankFailure

    def deep() -> None:
        raise WorkerFailedError([RankFailure(rank=0, summary="ValueError: x")])

    @report.entry_point("phalanx.run")
    def launcher(what: str) -> None:
        if what == "fail":
            deep()
        raise KeyboardInterrupt

    with pytest.raises(WorkerFailedError) as info:
        launcher("fail")
    assert [f.name for f in traceback.extract_tb(info.value.__traceback__)][-1] == "wrapper"
    with pytest.raises(KeyboardInterrupt):
        launcher("interrupt")
    assert capsys.readouterr().err == "phalanx.run: interrupted; all ranks were stopped\n"


def test_every_public_launcher_reports_through_the_entry_point() -> None:
    pytest.importorskip("pyspark")
    import phalanx
    import phalanx.spark
    from phalanx.spark import HorovodRunner, TorchDistributor

    for fn in (phalanx.run, phalanx.spark.run, HorovodRunner.run, TorchDistributor.run):
        assert fn.__code__ is report.entry_point("x")(lambda: None).__code__, fn  # the wrapper's code
