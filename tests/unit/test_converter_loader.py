"""The Spark converter's loader without Spark: exactly once per epoch, equal steps, seeds, resume, types."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from phalanx.errors import InvalidArgumentError, UsageError  # noqa: E402
from phalanx.spark import shards  # noqa: E402
from phalanx.spark.converter import SparkDatasetConverter, pieces_of  # noqa: E402
from phalanx.spark.loader import DataLoader, Reader  # noqa: E402
from phalanx.spark.transform import TransformSpec  # noqa: E402


def _write(path: Path, start: int, rows: int, group: int) -> None:
    ids = np.arange(start, start + rows)
    table = pa.table({
        "id": pa.array(ids, pa.int64()),
        "x": pa.array([[float(i), float(-i)] for i in ids], pa.list_(pa.float32())),
        "name": pa.array([f"row{i}" for i in ids]),
        "blob": pa.array([bytes([i % 256]) * 3 for i in ids], pa.binary()),
    })
    pq.write_table(table, path, row_group_size=group)


@pytest.fixture
def data(tmp_path: Path) -> SparkDatasetConverter:
    """Row groups of 40, 40, 20 (a) and 7, 3 (b), and an empty file: 110 rows, very uneven."""
    _write(tmp_path / "part-0.parquet", 0, 100, 40)
    _write(tmp_path / "part-1.parquet", 100, 10, 7)
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), tmp_path / "part-2.parquet")
    import fsspec

    pieces = pieces_of(fsspec.filesystem("file"), str(tmp_path))
    return SparkDatasetConverter(f"file://{tmp_path}", sorted({p.path for p in pieces}), 110, pieces)


def _ids(loader: Any) -> list[list[int]]:
    return [batch["id"].tolist() for batch in loader]


def _ranks(converter: SparkDatasetConverter, size: int, **kwargs: Any) -> list[list[list[int]]]:
    out = []
    for rank in range(size):
        with converter.make_torch_dataloader(cur_shard=rank, shard_count=size, **kwargs) as loader:
            out.append(_ids(loader))
    return out


@pytest.mark.parametrize("rows,batch,size", [(110, 8, 3), (10, 4, 3), (7, 3, 3), (2, 5, 3), (64, 32, 2),
                                             (65, 32, 2), (97, 1, 4)])
def test_split_reads_every_row_once_in_equal_steps(rows: int, batch: int, size: int) -> None:
    runs = [(0, 0, rows // 3), (1, 0, rows - rows // 3)]
    share = shards.split(runs, batch, size)
    seen = sorted((p, i) for chunk in share.chunks for p, lo, hi in chunk for i in range(lo, hi))
    assert seen == sorted((p, i) for p, lo, hi in runs for i in range(lo, hi))
    for rows_r in share.sizes:
        sizes = shards.batch_sizes(rows_r, batch, share.steps)
        assert len(sizes) == share.steps and sum(sizes) == rows_r
        assert all(s == batch for s in sizes[:-1]) and 0 <= sizes[-1] <= batch + 1


def test_every_row_once_per_epoch_across_ranks(data: SparkDatasetConverter) -> None:
    per_rank = _ranks(data, 3, batch_size=8, num_epochs=2, shuffling_queue_capacity=1)
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1  # every rank takes the same steps
    half = steps.pop() // 2
    for epoch in (slice(0, half), slice(half, None)):
        rows = sorted(i for batches in per_rank for batch in batches[epoch] for i in batch)
        assert rows == list(range(110))
    # each rank reads a stretch of the order, not every row group
    assert all(len({i // 40 for b in batches[:half] for i in b}) < 4 for batches in per_rank)


def test_seeded_order_is_the_same_on_a_rerun_and_changes_with_epoch_and_seed(data: SparkDatasetConverter) -> None:
    args = dict(batch_size=16, num_epochs=2, shuffling_queue_capacity=100, seed=3)
    first, again = _ranks(data, 2, **args), _ranks(data, 2, **args)
    assert first == again
    halves = [[i for b in batches[:len(batches) // 2] for i in b] for batches in first]
    rests = [[i for b in batches[len(batches) // 2:] for i in b] for batches in first]
    assert halves != rests
    assert _ranks(data, 2, **{**args, "seed": 4}) != first
    plain = _ranks(data, 1, batch_size=110, num_epochs=1, shuffle_row_groups=False)
    assert plain == [[list(range(110))]]


@pytest.mark.parametrize("size,batch", [(1, 3), (2, 8), (3, 3), (4, 7)])
def test_rows_in_file_order_are_decoded_in_chunks_with_the_whole_reads_rows(
        data: SparkDatasetConverter, monkeypatch: pytest.MonkeyPatch, size: int, batch: int) -> None:
    from phalanx.spark import loader as loader_module

    monkeypatch.setattr(loader_module, "CHUNK_BYTES", 1)  # one batch per chunk: runs end and start mid-group
    per_rank = _ranks(data, size, batch_size=batch, num_epochs=1, seed=2)
    with data.make_torch_dataloader(batch_size=batch) as whole:
        reader = whole.reader
        share = shards.split(reader.order(0), batch, size)
        expected = [[i for run in chunk for i in reader.read(run, 0, False)["id"].tolist()] for chunk in share.chunks]
    assert [[i for b in batches for i in b] for batches in per_rank] == expected
    assert sorted(i for e in expected for i in e) == list(range(110))


@pytest.mark.parametrize("before,after,steps", [(3, 2, 2), (2, 3, 1), (3, 3, 3), (1, 4, 5)])
def test_a_position_resumes_at_another_world_size(data: SparkDatasetConverter, before: int, after: int,
                                                  steps: int) -> None:
    args = dict(batch_size=6, num_epochs=1, shuffling_queue_capacity=1, seed=5)
    seen: list[int] = []
    states = []
    for rank in range(before):
        with data.make_torch_dataloader(cur_shard=rank, shard_count=before, **args) as loader:
            seen += [i for batch in itertools.islice(loader, steps) for i in batch["id"].tolist()]
            states.append(loader.state_dict())
    assert all(s == states[0] for s in states) and states[0]["segments"] == [[before, steps]]
    rest = []
    for rank in range(after):
        with data.make_torch_dataloader(**args) as loader:
            loader.load_state_dict(states[0])
            loader.set_shard(rank, after)
            rest.append(_ids(loader))
    assert len({len(r) for r in rest}) == 1  # equal steps after the reshard too
    assert sorted(seen + [i for r in rest for b in r for i in b]) == list(range(110))


def test_a_state_of_other_data_or_batch_size_is_refused(data: SparkDatasetConverter) -> None:
    with data.make_torch_dataloader(batch_size=4) as loader:
        state = loader.state_dict()
    with data.make_torch_dataloader(batch_size=5) as other, pytest.raises(UsageError, match="batch_size=4"):
        other.load_state_dict(state)


def test_types_arrays_strings_bytes(data: SparkDatasetConverter) -> None:
    with data.make_torch_dataloader(batch_size=4, num_epochs=1, shuffle_row_groups=False) as loader:
        batch = next(iter(loader))
    assert batch["id"].tolist() == [0, 1, 2, 3]
    assert tuple(batch["x"].shape) == (4, 2) and str(batch["x"].dtype) == "torch.float32"
    assert batch["name"] == ["row0", "row1", "row2", "row3"]
    assert batch["blob"][1] == b"\x01\x01\x01"


def test_transform_spec_decodes_bytes(data: SparkDatasetConverter) -> None:
    def decode(frame: Any) -> Any:
        frame["pixels"] = frame["blob"].map(lambda b: np.frombuffer(b, np.uint8).astype(np.float32))
        return frame

    spec = TransformSpec(decode, edit_fields=[("pixels", np.float32, (3,), False)], removed_fields=["blob"],
                         selected_fields=["id", "pixels"])
    with data.make_torch_dataloader(batch_size=5, num_epochs=1, shuffle_row_groups=False,
                                    transform_spec=spec) as loader:
        batch = next(iter(loader))
    assert sorted(batch) == ["id", "pixels"] and tuple(batch["pixels"].shape) == (5, 3)
    assert batch["pixels"][2].tolist() == [2.0, 2.0, 2.0]


def test_schema_fields_and_bad_arguments(data: SparkDatasetConverter) -> None:
    with data.make_torch_dataloader(batch_size=2, schema_fields=["id"], num_epochs=1) as loader:
        assert sorted(next(iter(loader))) == ["id"]
    with pytest.raises(InvalidArgumentError, match="predicate"):
        data.make_torch_dataloader(predicate=object())
    with pytest.raises(InvalidArgumentError, match="cur_shard=3"):
        data.make_torch_dataloader(cur_shard=3, shard_count=2)


def test_variable_length_arrays_and_nulls_are_named(tmp_path: Path) -> None:
    pq.write_table(pa.table({"v": pa.array([[1.0], [1.0, 2.0]]), "n": pa.array([1.0, None])}), tmp_path / "a.parquet")
    import fsspec

    pieces = pieces_of(fsspec.filesystem("file"), str(tmp_path))
    for columns, message in ((["v"], "column 'v' has arrays of different lengths"), (["n"], "column 'n' has 1 null")):
        loader = DataLoader(Reader(str(tmp_path), pieces, schema_fields=columns), batch_size=2)
        with pytest.raises(UsageError, match=message):
            next(iter(loader))


def test_fewer_rows_than_ranks_gives_empty_batches_in_step(data: SparkDatasetConverter) -> None:
    tiny = SparkDatasetConverter(data.cache_dir_url, data.file_urls, 3, [p for p in data.pieces if p.rows == 3])
    per_rank = _ranks(tiny, 5, batch_size=4, num_epochs=1)
    assert [len(b) for b in per_rank] == [1] * 5
    assert sorted(i for batches in per_rank for b in batches for i in b) == [107, 108, 109]


def test_tf_dataset_of_named_tuples(data: SparkDatasetConverter) -> None:
    pytest.importorskip("tensorflow")
    with data.make_tf_dataset(batch_size=50, num_epochs=1, cur_shard=1, shard_count=2,
                              schema_fields=["id", "x", "name"]) as dataset:
        batches = list(dataset)
    assert [len(b.id) for b in batches] == [50, 5] and tuple(batches[0].x.shape) == (50, 2)
    assert batches[0].name.dtype.name == "string"
    assert sorted(int(i) for b in batches for i in b.id.numpy()) == sorted(
        i for batches_ in _ranks(data, 2, batch_size=50, num_epochs=1)[1:] for b in batches_ for i in b)
