"""DeepspeedTorchDistributor's checks before launch and what each rank runs (no Spark, no rank started)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.errors import InvalidArgumentError
from phalanx.spark import DeepspeedTorchDistributor
from phalanx.spark.deepspeed import DeepSpeedCall


def test_ranks_are_gpus_times_nodes_and_the_signature_is_pyspark_s() -> None:
    d = DeepspeedTorchDistributor(numGpus=2, nnodes=3, localMode=False, useGpu=False, deepspeedConfig=None)
    assert (d.num_processes, d.local_mode, d.use_gpu, d.deepspeed_config) == (6, False, False, None)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"numGpus": 0}, "numGpus must be a positive int"),
    ({"nnodes": "2"}, "nnodes must be a positive int"),
    ({"deepspeedConfig": 3}, "deepspeedConfig must be a dict, the path of a JSON file or None"),
    ({"deepspeedConfig": {"optimizer": object()}}, "cannot be written as JSON"),
    ({"deepspeedConfig": "/nonexistent/ds.json"}, r"'/nonexistent/ds.json' cannot be read on the driver"),
])
def test_bad_arguments_fail_before_launch(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        DeepspeedTorchDistributor(**{"useGpu": False, **kwargs})


@pytest.mark.parametrize(("text", "message"), [("{not json", "is not JSON: Expecting"),
                                               ("[1, 2]", "holds a JSON list")])
def test_a_config_file_must_be_a_json_object(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=message):
        DeepspeedTorchDistributor(useGpu=False, deepspeedConfig=str(path))


def test_a_script_gets_pyspark_s_flags_and_a_private_copy_of_the_config(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script = tmp_path / "train.py"
    script.write_text("import json, sys, helper\n"
                      "path = sys.argv[sys.argv.index('--deepspeed_config') + 1]\n"
                      "print(json.dumps({'argv': sys.argv[1:-1], 'config': json.load(open(path)), "
                      "'helper': helper.VALUE, 'name': __name__, 'path': path}))\n")
    before = list(sys.argv)
    assert DeepSpeedCall(str(script), ("--lr", "0.1"), {}, json.dumps({"a": 1}))() is None
    out = json.loads(capsys.readouterr().out)
    assert out["argv"] == ["--lr", "0.1", "--deepspeed", "--deepspeed_config"]
    assert (out["config"], out["helper"], out["name"]) == ({"a": 1}, 7, "__main__")
    assert not Path(out["path"]).exists() and sys.argv == before


def test_a_function_sees_only_the_flag_without_a_config() -> None:
    assert DeepSpeedCall(lambda x: (x, sys.argv[1:]), (5,))() == (5, ["--deepspeed"])


def test_a_script_takes_no_keyword_arguments(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(InvalidArgumentError, match="no keyword arguments"):
        DeepspeedTorchDistributor(useGpu=False).run(str(script), lr=1)
