"""Sharded checkpoints on a real S3-compatible server (moto's, through s3fs): reshard, async, keep-last,
completion markers, and a whole job killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.waits import wait_gone, wait_until

pytest.importorskip("s3fs")
pytest.importorskip("moto")

import _ckpt_job as job
import _ds_ckpt_job as ds_job

import phalanx

HERE = Path(__file__).parent


def _ls(url: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://")))


@pytest.mark.timeout(120)
def test_a_zero_style_partition_saved_by_2_ranks_loads_at_3(s3: dict[str, str]) -> None:
    url = "s3://ckpt/partition"
    phalanx.run(job.partitioned, (url, True), np=2, env=s3)
    assert _ls(url) == ["step-0000000001"]
    assert _ls(f"{url}/step-0000000001") == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp"]
    out = phalanx.run(job.partitioned, (url, False), np=3, env=s3)
    # 10 rows over 3 ranks: 4, 4, 2 (torch's Shard(0) split), each rank holding exactly its own
    assert [len(rows) // 3 for rows in out] == [4, 4, 2]
    assert [r for rows in out for r in rows] == [float(i) for i in range(job.PARAM_ROWS * 3)]


@pytest.mark.timeout(240)
def test_a_whole_job_killed_resumes_from_the_latest_complete_step(s3: dict[str, str], tmp_path: Path) -> None:
    """2 ranks of FSDP2 save asynchronously every 2 steps; the driver is SIGKILLed at step 7 (its ranks die
    with it); a fresh job of 1 rank with resume=True starts from step 6, the weights of step 6 exactly."""
    url, record = "s3://ckpt/fsdp", str(tmp_path / "record.jsonl")
    code = ("import sys, phalanx, _ckpt_job as job\n"
            f"phalanx.run(job.train, ({url!r}, 10, {record!r}, 7), np=2)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=HERE, env={**os.environ, **s3},
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def reached() -> bool:
            assert driver.poll() is None, driver.stderr.read().decode()[-3000:] if driver.stderr else ""
            return Path(f"{record}.reached").exists()

        wait_until(reached, 180, "the job reached step 7")
        os.killpg(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait(30)
        if driver.stderr:
            driver.stderr.close()
    wait_gone(int(Path(f"{record}.reached").read_text()), 30, "rank 0 of the killed driver")
    assert _ls(url) == ["step-0000000004", "step-0000000006"]  # keep_last=2
    weights = {r["step"]: r["sums"] for r in map(json.loads, Path(record).read_text().splitlines())}
    out = phalanx.run(job.train, (url, 10, record), np=1, env=s3)
    assert out[0]["start"] == 6 and out[0]["restored"] == weights[6]
    assert out[0]["steps"] == [8, 10] and _ls(url) == ["step-0000000008", "step-0000000010"]


def test_durable_elastic_commits_to_the_same_storage(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """PHALANX_ELASTIC_CHECKPOINT_DIR as an s3:// URL: rank 0's commit is one whole object, and a restarted
    job's rank 0 resumes from it."""
    from phalanx.env import names as env_names
    from phalanx.torch.elastic.state import ObjectState

    monkeypatch.setenv(env_names.PHALANX_ELASTIC_CHECKPOINT_DIR, "s3://ckpt/elastic")
    fresh = ObjectState(lambda value: value, lambda: 0, epoch=0, batch=0)
    assert not fresh.resume_from_checkpoint()
    fresh.epoch, fresh.batch = 3, 7
    fresh.commit()
    assert _ls("s3://ckpt/elastic") == ["state.pt"]
    restarted = ObjectState(lambda value: value, lambda: 0, epoch=0, batch=0)
    assert restarted.resume_from_checkpoint() and (restarted.epoch, restarted.batch) == (3, 7)


def test_the_converter_loader_reads_parquet_on_s3(s3: dict[str, str]) -> None:
    """The converter's ranks read through fsspec: its data on an s3:// cache directory loads as locally."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import s3fs

    from phalanx.spark.converter import SparkDatasetConverter, list_pieces

    fs = s3fs.S3FileSystem()
    for part, start in (("part-0", 0), ("part-1", 30)):
        with fs.open(f"ckpt/converter/{part}.parquet", "wb") as f:
            pq.write_table(pa.table({"id": pa.array(range(start, start + 30), pa.int64())}), f, row_group_size=7)
    pieces = list_pieces("s3://ckpt/converter", {})
    converter = SparkDatasetConverter("s3://ckpt/converter", [p.path for p in pieces], 60, pieces)
    seen = []
    for rank in range(2):
        with converter.make_torch_dataloader(batch_size=8, num_epochs=1, cur_shard=rank, shard_count=2) as loader:
            seen += [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(seen) == list(range(60))
    converter.delete()
    assert not fs.exists("ckpt/converter")


@pytest.mark.timeout(240)
def test_deepspeed_zero_2_and_3_in_deepspeeds_format_locally_and_on_s3(s3: dict[str, str], tmp_path: Path) -> None:
    """DeepSpeed's own engine.save_checkpoint layout through the checkpoint storage: each rank's ZeRO files,
    ``latest``, the marker, keep-last-2; fresh engines load exact weights and optimizer state; a rank's
    failure is an error on every rank."""
    local, url = tmp_path / "zero2", "s3://ckpt/zero3"
    out = phalanx.run(ds_job.job, (str(local), url), np=2, env={**s3, "DS_BUILD_OPS": "0"})
    for rank in out:
        for stage in ("zero2", "zero3"):
            assert rank[stage] == {"steps": [3, 4], "step": 4, "client": 32, "restored_exact": True,
                                   "next_step_exact": True, "moved": True}, (stage, rank)
        assert "could not save DeepSpeed checkpoint step 1 to s3://no-such-bucket/run/step-0000000001: rank 0 " \
            "(and 1 more rank(s))" in rank["error"]
    # DeepSpeed's layout: its recovery scripts beside ``latest``, no staging directory left
    assert sorted(p.name for p in local.iterdir()) == ["latest", "step-0000000003", "step-0000000004",
                                                       "zero_to_fp32.py", "zero_to_torch.py"]
    assert (local / "latest").read_text() == "step-0000000004"
    optim = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert sorted(p.name for p in (local / "step-0000000004").iterdir()) == \
        ["COMPLETE", "mp_rank_00_model_states.pt", *optim]
    assert _ls(url) == ["latest", "step-0000000003", "step-0000000004", "zero_to_fp32.py", "zero_to_torch.py"]
    # ZeRO-3: every rank writes its partition of the module too
    assert _ls(f"{url}/step-0000000004") == ["COMPLETE", *sorted(optim + [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)])]
