"""DeepSpeed on a real ``local[2]`` Spark: DeepspeedTorchDistributor on the cluster (an unchanged script with a
config file; TorchDistributor's Spark path underneath), a DeepSpeed function under HorovodRunner; ZeRO 1-3 in
each job (tests/multiprocess/deepspeed/_zero_job.py). A script as a command rank is phalanxrun's path
(tests/multiprocess/deepspeed, tests/hosts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.errors import SlotsUnavailableError
from phalanx.spark import DeepspeedTorchDistributor, HorovodRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multiprocess" / "deepspeed"))
import _zero_job as job

pytestmark = [pytest.mark.spark, pytest.mark.usefixtures("local_spark"), pytest.mark.timeout(240)]

SCRIPT = job.__file__


def records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line.partition("ZERO ")[2]) for line in stdout.splitlines() if "ZERO {" in line]


def test_deepspeed_distributor_runs_a_script_on_the_cluster_with_a_config_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"gradient_clipping": 1.0}))
    out = DeepspeedTorchDistributor(numGpus=1, nnodes=2, localMode=False, useGpu=False,
                                    deepspeedConfig=str(config)).run(SCRIPT, "--tag", "cluster")
    assert out is None  # as pyspark's for a script
    got = records(capsys.readouterr().out)
    job.check(got, world=2)
    assert all(r["base"] == {"gradient_clipping": 1.0} and r["deepspeed_flag"] and r["tag"] == "cluster"
               for r in got)


def test_more_ranks_than_the_cluster_has_fail_before_launch() -> None:
    with pytest.raises(SlotsUnavailableError,
                       match=r"numGpus=2, nnodes=2\) runs num_processes=4 ranks: 4 ranks were asked for"):
        DeepspeedTorchDistributor(numGpus=2, nnodes=2, localMode=False, useGpu=False).run(job.train)


def test_horovod_runner_runs_a_deepspeed_function() -> None:
    got = HorovodRunner(np=2).run(job.train)
    job.check([got], world=2, ranks=[0])
