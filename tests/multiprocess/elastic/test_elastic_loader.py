"""The converter's loader in an elastic job: a SIGKILLed rank, and the epoch goes on where the commit was."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import phalanx  # noqa: E402
from phalanx.env import names as env_names  # noqa: E402
from phalanx.spark.converter import SparkDatasetConverter, pieces_of  # noqa: E402

ROWS = 103


def _converter(tmp_path: Path) -> SparkDatasetConverter:
    import fsspec

    for name, start, stop, group in (("part-0", 0, 70, 30), ("part-1", 70, ROWS, 11)):
        pq.write_table(pa.table({"id": pa.array(range(start, stop), pa.int64())}),
                       tmp_path / f"{name}.parquet", row_group_size=group)
    pieces = pieces_of(fsspec.filesystem("file"), str(tmp_path))
    return SparkDatasetConverter(str(tmp_path), [p.path for p in pieces], ROWS, pieces)


def read_with_a_kill(converter: SparkDatasetConverter, kill_at: int, marker: str) -> dict[str, Any]:
    """Every step gathers the ranks' row ids into the state; rank 1 SIGKILLs itself once at ``kill_at``."""
    import phalanx.torch as hvd

    hvd.init()
    with converter.make_torch_dataloader(batch_size=4, num_epochs=1, shuffling_queue_capacity=1, seed=9) as loader:
        state = hvd.elastic.TorchState(None, None, loader=loader, step=0, seen=[])

        @hvd.elastic.run
        def loop(state: hvd.elastic.TorchState) -> None:
            for batch in state.loader:
                if state.step == kill_at and hvd.rank() == 1 and not os.path.exists(marker):
                    Path(marker).write_text("killed")
                    os.kill(os.getpid(), signal.SIGKILL)
                state.seen += [i for ids in hvd.allgather_object(batch["id"].tolist()) for i in ids]
                state.step += 1
                if state.step % 3 == 0:
                    state.commit()

        loop(state)
    return {"seen": state.seen, "size": hvd.size()}


@pytest.mark.timeout(120)
def test_a_sigkilled_rank_neither_repeats_nor_skips_rows(tmp_path: Path) -> None:
    converter = _converter(tmp_path)
    marker = str(tmp_path / "killed")
    out = phalanx.run(read_with_a_kill, (converter, 7, marker), np=2, min_np=1, max_np=2, reset_limit=2,
                      env={env_names.PHALANX_ELASTIC_TIMEOUT_S: "30"})
    assert Path(marker).exists(), "rank 1 never died"
    seen = out[0]["seen"]
    assert sorted(seen) == list(range(ROWS)), (len(seen), len(set(seen)))
