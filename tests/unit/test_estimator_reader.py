"""The estimators' data path without Spark: sharding, equal steps, seeded shuffling, vectors from Arrow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from phalanx.errors import InvalidArgumentError  # noqa: E402
from phalanx.spark.estimator.reader import Piece, ShardReader, assign, steps_per_epoch  # noqa: E402
from phalanx.spark.estimator.schema import ColumnSpec, check_shapes, check_validation  # noqa: E402
from phalanx.spark.estimator.store import LocalStore, Store, check_run_id  # noqa: E402
from phalanx.spark.estimator.transform import vectors_to_numpy  # noqa: E402

X = ColumnSpec("x", "array", 3, "float32")
Y = ColumnSpec("y", "scalar", 1, "int64")


def _write(path: Path, start: int, rows: int, group: int) -> list[Piece]:
    ids = np.arange(start, start + rows)
    table = pa.table({"x": pa.array([[float(i)] * 3 for i in ids], pa.list_(pa.float32())), "y": pa.array(ids)})
    pq.write_table(table, path, row_group_size=group)
    meta = pq.ParquetFile(path).metadata
    return [Piece(str(path), g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]


@pytest.fixture
def uneven(tmp_path: Path) -> list[Piece]:
    """Row groups of 40, 40, 20 (file a) and 7, 3 (file b): 110 rows, very uneven."""
    return _write(tmp_path / "a.parquet", 0, 100, 40) + _write(tmp_path / "b.parquet", 100, 10, 7)


def _epoch(pieces: list[Piece], rank: int, size: int, steps: int, epoch: int = 0, shuffle: bool = True,
           batch: int = 8) -> list[dict[str, np.ndarray]]:
    reader = ShardReader(lambda path: open(path, "rb"), pieces, [X, Y], rank, size, batch, shuffle, seed=7)
    return list(reader.epoch(epoch, steps))


def test_assignment_covers_every_group_once_and_balances_rows(uneven: list[Piece]) -> None:
    shares = [assign(uneven, r, 2)[0] for r in range(2)]
    assert sorted(p for s in shares for p in s) == sorted(uneven)
    assert [sum(p.rows for p in s) for s in shares] == [60, 50]
    pieces, stride = assign(uneven[:1], 1, 2)  # fewer groups than ranks: every rank strides
    assert (pieces, stride) == (uneven[:1], 2)


def test_every_rank_takes_the_same_steps_of_full_batches(uneven: list[Piece]) -> None:
    steps = steps_per_epoch(110, 8, 3, None, training=True)
    assert steps == 4
    for rank in range(3):
        batches = _epoch(uneven, rank, 3, steps=11)  # more than some shares hold: they wrap around
        assert len(batches) == 11 and all(len(b["y"]) == 8 for b in batches)
    assert steps_per_epoch(110, 8, 3, None, training=False) == 5
    assert steps_per_epoch(110, 8, 3, 2, training=True) == 2


def test_shares_are_disjoint_and_rows_stay_whole(uneven: list[Piece]) -> None:
    seen = [np.concatenate([b["y"] for b in _epoch(uneven, r, 2, steps=6, shuffle=False)]) for r in range(2)]
    assert not set(seen[0]) & set(seen[1])
    for rank in range(2):
        batch = _epoch(uneven, rank, 2, steps=1)[0]
        np.testing.assert_array_equal(batch["x"], np.repeat(batch["y"][:, None], 3, axis=1).astype(np.float32))
        assert batch["x"].dtype == np.float32 and batch["y"].dtype == np.int64


def test_shuffle_is_seeded_per_epoch(uneven: list[Piece]) -> None:
    first = np.concatenate([b["y"] for b in _epoch(uneven, 0, 2, steps=6, epoch=0)])
    again = np.concatenate([b["y"] for b in _epoch(uneven, 0, 2, steps=6, epoch=0)])
    other = np.concatenate([b["y"] for b in _epoch(uneven, 0, 2, steps=6, epoch=1)])
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert sorted(first) != list(first)


def test_strided_shares_split_a_single_group(tmp_path: Path) -> None:
    pieces = _write(tmp_path / "one.parquet", 0, 10, 100)
    got = [np.concatenate([b["y"] for b in _epoch(pieces, r, 2, steps=1, shuffle=False, batch=5)]) for r in range(2)]
    assert [list(g) for g in got] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


def test_vectors_decode_dense_and_sparse_rows() -> None:
    struct = pa.StructArray.from_arrays(
        [pa.array([1, 0, 0], pa.int8()), pa.array([None, 4, 4], pa.int32()),
         pa.array([None, [1, 3], []], pa.list_(pa.int32())),
         pa.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0], []], pa.list_(pa.float64()))],
        names=["type", "size", "indices", "values"])
    np.testing.assert_array_equal(vectors_to_numpy(struct, 4), [[1, 2, 3, 4], [0, 5, 0, 6], [0, 0, 0, 0]])


def test_bad_values_are_refused_with_the_fix() -> None:
    for bad in (1, 1.5, -0.1, True, [0.1]):
        with pytest.raises(InvalidArgumentError, match="validation"):
            check_validation(bad)
    check_validation(0.2)
    check_validation("is_val")
    with pytest.raises(InvalidArgumentError, match=r"'x' has 3 value\(s\) per row.*\[-1, 2, 2\]"):
        check_shapes([X], [[-1, 2, 2]], "input_shapes")
    check_shapes([X], [[-1, 3, 1]], "input_shapes")
    for bad_id in ("../up", "a/b", "", "x" * 200):
        with pytest.raises(InvalidArgumentError, match="run_id"):
            check_run_id(bad_id)


def test_store_layout_checkpoints_and_create(tmp_path: Path) -> None:
    store = Store.create(f"file://{tmp_path}")
    assert isinstance(store, LocalStore)
    assert store.get_train_data_path("r1") == f"{tmp_path}/runs/r1/data/train"
    assert store.last_checkpoint("r1") is None
    for epoch in (0, 1, 10):
        store.write(f"{store.get_checkpoint_path('r1')}/{store.get_checkpoint_filename(epoch)}", b"c")
    assert store.last_checkpoint("r1") == (10, f"{tmp_path}/runs/r1/checkpoints/epoch-0010.pt")
    store.append_text(f"{tmp_path}/log", "a\n")
    store.append_text(f"{tmp_path}/log", "b\n")
    assert store.read(f"{tmp_path}/log") == b"a\nb\n"
    assert store.spark_url("/x") == "file:///x"
    memory = Store.create("memory://estimator-test")
    assert type(memory).__name__ == "FilesystemStore" and memory.spark_url("/p") == "memory:///p"


def test_prefetched_keeps_order_raises_in_place_and_stops_with_the_consumer() -> None:
    import threading

    from phalanx.spark.estimator.reader import prefetched

    assert list(prefetched(iter(range(10)), 3)) == list(range(10))

    def failing() -> Any:
        yield 1
        raise OSError("disk")

    got = []
    with pytest.raises(OSError, match="disk"):
        for item in prefetched(failing(), 2):
            got.append(item)
    assert got == [1]
    started = threading.active_count()
    stream = prefetched(iter(range(1000)), 2)
    assert next(stream) == 0
    stream.close()  # the consumer stops early (fit took steps_per_epoch batches): the thread ends
    for _ in range(50):
        if threading.active_count() < started + 1:
            break
        threading.Event().wait(0.05)
    assert threading.active_count() <= started


def test_hdfs_and_dbfs_stores_take_horovods_paths() -> None:
    from phalanx.spark.common.store import DBFSLocalStore, HDFSStore, Store

    full = HDFSStore("hdfs://namenode01:8020/user/test/runs", user="me")
    assert full.storage_options["host"] == "namenode01" and full.storage_options["port"] == 8020
    assert full.storage_options["user"] == "me" and full.spark_url("/user/test/runs/x") == (
        "hdfs://namenode01:8020/user/test/runs/x")
    bare = HDFSStore("/user/test/runs", host="nn", port=9000)
    assert (bare.storage_options["host"], bare.storage_options["port"], bare.prefix_path) == (
        "nn", 9000, "hdfs:///user/test/runs")
    assert HDFSStore("hdfs:///user/x").storage_options["host"] == "default"
    for bad in ("s3://bucket/x", "relative/path"):
        with pytest.raises(InvalidArgumentError, match="HDFSStore"):
            HDFSStore(bad)
    for spelling in ("dbfs:/ml/runs", "/dbfs/ml/runs", "file:/dbfs/ml/runs", "file:///dbfs/ml/runs"):
        assert DBFSLocalStore(spelling).prefix_path == "/dbfs/ml/runs"
        assert type(Store.create(spelling)) is DBFSLocalStore
    with pytest.raises(InvalidArgumentError, match="not a DBFS path"):
        DBFSLocalStore("dbfs://host/x")
    assert type(Store.create("hdfs://nn:8020/x")) is HDFSStore


def test_hdfs_store_runs_on_fsspecs_hdfs_filesystem_backed_by_local_disk(tmp_path: Path) -> None:
    """HDFSStore through fsspec's real ``hdfs`` filesystem class (its URL parsing and pyarrow wrapper), with
    only the bytes' home swapped: pyarrow's local filesystem instead of its HadoopFileSystem (libhdfs and a
    namenode, which this machine has not). What it cannot show: the connection, Kerberos, HDFS's rename."""
    fsspec = pytest.importorskip("fsspec")
    arrow = pytest.importorskip("fsspec.implementations.arrow")
    from pyarrow import fs as pafs


    connections: list[dict[str, Any]] = []

    class LocalBackedHDFS(arrow.HadoopFileSystem):  # type: ignore[misc]
        cachable = False

        def __init__(self, host: str = "default", port: int = 0, user: str | None = None,
                     kerb_ticket: str | None = None, replication: int = 3, extra_conf: Any = None,
                     **kwargs: Any) -> None:
            connections.append({"host": host, "port": port, "user": user, "kerb_ticket": kerb_ticket,
                                "extra_conf": extra_conf})
            arrow.ArrowFSWrapper.__init__(self, fs=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem()),
                                          **kwargs)

    fsspec.register_implementation("hdfs", LocalBackedHDFS, clobber=True)
    try:
        _exercise_hdfs_store(tmp_path, connections)
    finally:
        fsspec.register_implementation("hdfs", arrow.HadoopFileSystem, clobber=True)


def _exercise_hdfs_store(tmp_path: Path, connections: list[dict[str, Any]]) -> None:
    from phalanx.spark.common.store import HDFSStore

    store = HDFSStore("hdfs://namenode01:8020/user/me/runs", user="me", kerb_ticket="/tmp/krb5cc",
                      extra_conf={"dfs.replication": "2"})
    ckpt = store.get_checkpoint_path("run1")
    store.write(f"{ckpt}/{store.get_checkpoint_filename(0)}", b"zero")
    store.write(f"{ckpt}/{store.get_checkpoint_filename(3)}", b"three")
    assert connections == [{"host": "namenode01", "port": 8020, "user": "me", "kerb_ticket": "/tmp/krb5cc",
                            "extra_conf": {"dfs.replication": "2"}}]
    assert store.root == "/user/me/runs" and ckpt == "/user/me/runs/runs/run1/checkpoints"
    assert (tmp_path / "user/me/runs/runs/run1/checkpoints/epoch-0003.pt").read_bytes() == b"three"
    assert store.last_checkpoint("run1") == (3, f"{ckpt}/epoch-0003.pt")
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "user/me/runs/runs/run1/checkpoints").iterdir())
    logs = f"{store.get_logs_path('run1')}/history.jsonl"
    store.append_text(logs, "a\n")
    store.append_text(logs, "b\n")
    assert store.read(logs) == b"a\nb\n"
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1, 2, 3]}), sink)
    data = f"{store.get_train_data_path('run1')}/part-0.parquet"
    store.write(data, sink.getvalue().to_pybytes())
    with store.open_read(data) as f:
        assert pq.read_table(f).to_pydict() == {"x": [1, 2, 3]}
    assert store.spark_url(data) == "hdfs://namenode01:8020/user/me/runs/runs/run1/data/train/part-0.parquet"
    store.remove(store.get_run_path("run1"))
    assert not store.exists(ckpt) and not (tmp_path / "user/me/runs/runs/run1").exists()
