"""A collective issued on one rank only: the error names the user's collective and the rank missing from it,
whether that rank is alive and busy elsewhere (after the stall warning: the hang report with every rank's
Python stack and Flight Recorder tail) or gone, over the shared-memory transport and over gloo; it never
suggests turning shared memory off."""

from __future__ import annotations

import time

import pytest

import phalanx
from phalanx.errors import WorkerFailedError

pytestmark = [pytest.mark.multiprocess]

STALL = {"PHALANX_STALL_CHECK_S": "0.5", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
         "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def _busy_elsewhere() -> None:
    time.sleep(60)  # the report must show this frame: a rank busy outside any collective


def _rank_1_skips_val_loss(leaves: bool) -> int:
    import torch

    import phalanx.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(2), name="warmup")
    if hvd.rank() == 1:
        if leaves:
            return 1  # the rank ends without the collective its peer issues
        _busy_elsewhere()
    hvd.allreduce(torch.ones(2), name="val_loss")
    return 0


def _failure(shm: str, leaves: bool) -> str:
    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(_rank_1_skips_val_loss, args=(leaves,), np=2, env={**STALL, "PHALANX_SHM": shm})
    root = info.value.root_cause
    assert root.rank == 0, str(info.value)
    text = f"{root.summary}\n{root.traceback}\n" + "\n".join(root.log_tail)
    assert "PHALANX_SHM=0" not in text
    return text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_a_peer_alive_and_busy_is_named_with_every_ranks_stack(shm: str) -> None:
    text = _failure(shm, leaves=False)
    assert "allreduce 'val_loss' (process set 0, ranks [0, 1]) lacks rank(s) [1]: rank 1 is not in any " \
           "phalanx collective" in text, text
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3" in text
    # the hang report: every rank's section, the busy rank's stack where it is, the Flight Recorder's tail
    assert "phalanx hang report (rank 0" in text
    assert "--- rank 0 " in text and "waits in allreduce 'val_loss'" in text
    assert "--- rank 1 " in text and "not in any phalanx collective" in text
    rank1 = text[text.index("--- rank 1 "):]
    assert "_busy_elsewhere" in rank1 and "time.sleep(60)" in rank1, rank1
    assert "Flight Recorder" in text and "gloo:" in text
    assert text.count("phalanx hang report") == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "gloo"])
def test_a_peer_gone_is_named_with_the_pending_collective(shm: str) -> None:
    text = _failure(shm, leaves=True)
    assert "allreduce 'val_loss' (process set 0, ranks [0, 1])" in text, text
    if shm == "1":
        assert "cannot complete: peer rank 1 (pid " in text and "has died or exited before reaching it" in text
    else:
        assert "lacks rank(s) [1]: rank 1 is not in any phalanx collective" in text


def _dump_then_abort_as_the_nccl_watchdog_does() -> None:
    """Rank 1 does what torch's NCCL watchdog does on a timeout (no NCCL here): it writes its Flight Recorder
    pickle to ``<TORCH_FR_DUMP_TEMP_FILE><rank>`` and aborts; rank 0 meanwhile waits as in a hung NCCL kernel
    (outside phalanx, which stops it)."""
    import os
    import pickle

    import phalanx.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        entry = {"collective_seq_id": 7, "profiling_name": "nccl:all_reduce", "process_group": ("0", "default_pg"),
                 "state": "started", "input_sizes": [[1024]], "input_dtypes": ["Float"],
                 "frames": [{"name": "train_step", "filename": "train.py", "line": 41}]}
        dump = {"version": "2.10", "entries": [entry],
                "pg_status": {"0": {"last_enqueued_collective": 7, "last_started_collective": 7,
                                    "last_completed_collective": 6}}}
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(hvd.rank()), "wb") as f:
            pickle.dump(dump, f)
        os.abort()
    time.sleep(60)


@pytest.mark.timeout(120)
def test_torchs_own_dump_of_a_rank_the_watchdog_aborted_reaches_the_failure_report() -> None:
    import os

    with pytest.raises(WorkerFailedError) as info:
        phalanx.run(_dump_then_abort_as_the_nccl_watchdog_does, np=2)
    root = info.value.root_cause
    assert root.rank == 1 and "SIGABRT" in root.summary, str(info.value)
    report = str(info.value)
    head = "phalanx: torch's Flight Recorder dump of rank 1 (written by NCCL's watchdog; kept at "
    assert head in report, report
    assert "  group 0: last enqueued #7, started #7, completed #6" in report
    assert "  #7 nccl:all_reduce on group 0 (started) inputs [[1024]] ['Float'] at train.py:41 in train_step" in report
    kept = report.split(head, 1)[1].split(")", 1)[0].split(":", 1)[1]
    assert os.path.basename(kept) == "nccl_trace_rank_1" and os.path.isfile(kept)  # kept for torch's fr_trace
    assert oct(os.stat(os.path.dirname(kept)).st_mode & 0o777) == "0o700"
    os.unlink(kept)
    os.rmdir(os.path.dirname(kept))
