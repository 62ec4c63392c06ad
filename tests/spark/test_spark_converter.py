"""make_spark_converter on ``local[2]``: Petastorm's conversions, refusals, the plan-keyed cache, delete()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("torch")

from phalanx.errors import InvalidArgumentError
from phalanx.spark import converter as converter_module
from phalanx.spark import make_spark_converter

pytestmark = [pytest.mark.spark]


@pytest.fixture
def cache(local_spark: Any, tmp_path: Path) -> Any:
    local_spark.conf.set(converter_module.PARENT_CACHE_DIR_URL_CONF, f"file://{tmp_path}")
    yield tmp_path
    local_spark.conf.unset(converter_module.PARENT_CACHE_DIR_URL_CONF)


def _frame(spark: Any) -> Any:
    from pyspark.ml.linalg import Vectors

    rows = [(i, float(i) / 2, [float(i), 1.0], Vectors.dense([i, -i]), f"r{i}", bytes([i]), i % 2 == 0)
            for i in range(50)]
    return spark.createDataFrame(rows, ["id", "half", "pair", "vec", "name", "raw", "even"]).repartition(3)


@pytest.mark.timeout(120)
def test_converter_types_cache_and_delete(local_spark: Any, cache: Path) -> None:
    """Doubles, double arrays and vectors arrive as float32; the same plan is written once; delete() removes it."""
    df = _frame(local_spark)
    conv = make_spark_converter(df)
    assert len(conv) == 50 and conv.cache_dir_url.startswith(f"file://{cache}/")
    with conv.make_torch_dataloader(batch_size=50, num_epochs=1) as loader:
        batch = next(iter(loader))
    assert sorted(batch["id"].tolist()) == list(range(50))
    assert {str(batch[c].dtype) for c in ("half", "pair", "vec")} == {"torch.float32"}
    assert tuple(batch["vec"].shape) == (50, 2) and batch["even"].dtype.is_floating_point is False
    assert isinstance(batch["name"][0], str) and isinstance(batch["raw"][0], bytes)
    again = make_spark_converter(df.select("*"))  # the same plan: no second write
    assert again.cache_dir_url == conv.cache_dir_url and len(list(cache.iterdir())) == 1
    assert make_spark_converter(df, dtype=None).cache_dir_url != conv.cache_dir_url
    conv.delete()
    assert not Path(conv.cache_dir_url[len("file://"):]).exists()
    fresh = make_spark_converter(df)  # forgotten by delete(): written again
    assert fresh.cache_dir_url != conv.cache_dir_url and Path(fresh.cache_dir_url[len("file://"):]).is_dir()
    fresh.delete()


@pytest.mark.timeout(60)
def test_converter_refuses_before_writing(local_spark: Any, cache: Path) -> None:
    from pyspark.sql import functions as F

    df = local_spark.range(3).withColumn("m", F.create_map(F.lit("k"), F.col("id")))
    with pytest.raises(InvalidArgumentError, match="column 'm' has type map<string,bigint>"):
        make_spark_converter(df)
    with pytest.raises(InvalidArgumentError, match="compression_codec='zip'"):
        make_spark_converter(local_spark.range(3), compression_codec="zip")
    local_spark.conf.unset(converter_module.PARENT_CACHE_DIR_URL_CONF)
    with pytest.raises(InvalidArgumentError, match=r"petastorm\.spark\.converter\.parentCacheDirUrl"):
        make_spark_converter(local_spark.range(3))
    assert list(cache.iterdir()) == []


@pytest.mark.timeout(180)
def test_converter_cache_on_s3_written_by_the_executors(local_spark: Any, s3: dict[str, str]) -> None:
    """Spark has no filesystem for ``s3://`` here (no hadoop-aws): the executors write each partition through
    fsspec, the driver writes ``_SUCCESS``; every row is read back once; the plan keys the cache; delete()."""
    import s3fs

    options = {"key": s3["AWS_ACCESS_KEY_ID"], "secret": s3["AWS_SECRET_ACCESS_KEY"],
               "client_kwargs": {"endpoint_url": s3["AWS_ENDPOINT_URL"], "region_name": "us-east-1"}}
    local_spark.conf.set(converter_module.PARENT_CACHE_DIR_URL_CONF, "s3://ckpt/converter")
    try:
        df = _frame(local_spark)
        conv = make_spark_converter(df, parquet_row_group_size_bytes=512, compression_codec="zstd",
                                    storage_options=options)
        again = make_spark_converter(df.select("*"), parquet_row_group_size_bytes=512, compression_codec="zstd",
                                     storage_options=options)
    finally:
        local_spark.conf.unset(converter_module.PARENT_CACHE_DIR_URL_CONF)
    fs = s3fs.S3FileSystem(**options)
    root = conv.cache_dir_url.removeprefix("s3://")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root))
    assert conv.cache_dir_url.startswith("s3://ckpt/converter/") and again.cache_dir_url == conv.cache_dir_url
    assert names == ["_SUCCESS", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert len(conv) == 50 and len(conv.pieces) > 3  # 512-byte row groups: several per file
    ids = []
    for rank in range(2):
        with conv.make_torch_dataloader(batch_size=7, num_epochs=1, cur_shard=rank, shard_count=2) as loader:
            for batch in loader:
                ids += batch["id"].tolist()
                assert tuple(batch["vec"].shape)[1:] == (2,) and isinstance(batch["raw"][0], bytes)
    assert sorted(ids) == list(range(50))
    with pytest.raises(InvalidArgumentError, match="compression_codec='bzip2' cannot be written to s3://"):
        local_spark.conf.set(converter_module.PARENT_CACHE_DIR_URL_CONF, "s3://ckpt/converter")
        try:
            make_spark_converter(df, compression_codec="bzip2", storage_options=options)
        finally:
            local_spark.conf.unset(converter_module.PARENT_CACHE_DIR_URL_CONF)
    conv.delete()
    assert not fs.exists(root)
