"""Horovod's names a newcomer's existing code reaches for: ``horovodrun``, ``horovod.runner``, the import
lines of Horovod 0.28.1's examples, ``horovod.__file__``, ``SparkBackend``.

Each check runs in a fresh interpreter where the aliases are what a user's process gets.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: Every ``horovod`` import line of Horovod 0.28.1's examples/spark/**, examples/pytorch/**,
#: examples/keras/** and examples/tensorflow2/** (third-party lines, torchvision, petastorm..., are the
#: user's to install), with the files that have it.
EXAMPLE_IMPORTS: dict[str, str] = {
    "import horovod": "pytorch/pytorch_mnist.py, tensorflow2/tensorflow2_{keras_,}mnist.py",
    "import horovod.torch as hvd": "pytorch/*.py",
    "import horovod.keras as hvd": "keras/*.py",
    "import horovod.tensorflow as hvd": "tensorflow2/tensorflow2_{mnist,synthetic_benchmark}.py",
    "import horovod.tensorflow.keras as hvd": "tensorflow2/*keras*.py, spark/keras/*_run.py",
    "import horovod.spark": "spark/keras/keras_spark{,3}_rossmann*.py",
    "from horovod.spark import run": "spark/tensorflow2/tensorflow2_mnist_data_service.py",
    "import horovod.spark.torch as hvd": "spark/pytorch/pytorch_spark_mnist.py",
    "import horovod.spark.keras as hvd": "spark/keras/keras_spark_*estimator.py, keras_spark_mnist.py",
    "import horovod.spark.lightning as hvd": "spark/pytorch/pytorch_lightning_spark_mnist*.py",
    "from horovod.spark.lightning.estimator import MIN_PL_VERSION": "spark/pytorch/pytorch_lightning_spark_mnist*.py",
    "from horovod.spark.common.backend import SparkBackend": "spark/{keras,pytorch}/*estimator*.py, *_mnist.py",
    "from horovod.spark.common.store import Store": "spark/{keras,pytorch}/*.py",
    "from horovod.tensorflow.keras.callbacks import BestModelCheckpoint": "spark/keras/*rossmann_estimator.py",
}
#: Lines that do not resolve, and why (docs/migration.md says so too).
NOT_PROVIDED = {
    "from horovod.tensorflow.data.compute_service import TfDataServiceConfig, tf_data_service":
        "*/tensorflow2_mnist_data_service*.py: Horovod's tf.data service (a compute job of its own) has no "
        "phalanx counterpart",
}


def _python(code: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_every_horovod_import_line_of_horovods_examples_resolves() -> None:
    """In this interpreter (the unit tier imports TensorFlow and Lightning anyway: a fresh one would spend
    ~20 s on them); the aliases are the .pth hook's, as in a user's process."""
    pytest.importorskip("tensorflow")
    pytest.importorskip("pyspark")
    import phalanx.compat

    phalanx.compat.install()
    names: dict[str, Any] = {}
    for line in EXAMPLE_IMPORTS:
        exec(line, names)
    assert names["SparkBackend"].__module__ == "phalanx.spark.common.backend"
    assert names["Store"].__module__ == "phalanx.spark.estimator.store"
    assert names["MIN_PL_VERSION"] == "2.2.0" and names["BestModelCheckpoint"].__name__ == "BestModelCheckpoint"
    for line in NOT_PROVIDED:
        with pytest.raises(ModuleNotFoundError):
            exec(line, {})
    horovod = names["horovod"]
    assert os.path.isfile(horovod.__file__) and inspect.getfile(horovod) == horovod.__file__


def test_horovod_runner_run_and_launch_module() -> None:
    out = _python("import horovod.runner as r, phalanx.compat.horovod_run as h, horovod\n"
                  "print(r.run is h.run, horovod.run is h.run, r.__file__ == horovod.__file__)").stdout
    assert out.split() == ["True", "True", "True"]
    usage = subprocess.run([sys.executable, "-m", "horovod.runner.launch", "-np", "1", "--no-such-flag", "x"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert usage.returncode == 2 and usage.stderr.startswith("horovodrun: error: "), usage.stderr


def test_horovodrun_console_script_is_installed_beside_phalanxrun() -> None:
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")
               if e.name in ("horovodrun", "phalanxrun")}
    assert scripts == {"horovodrun": "phalanx.compat.horovodrun:main", "phalanxrun": "phalanx.cli.main:main"}


def test_horovodrun_hands_over_to_an_installed_horovod(tmp_path: Path) -> None:
    runner = tmp_path / "horovod" / "runner"
    runner.mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("")
    (runner / "__init__.py").write_text("")
    (runner / "launch.py").write_text("import sys\ndef run_commandline():\n    print('real', sys.argv[1:])\n")
    out = _python(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
                  "import phalanx.compat as c; c.install()\n"
                  "from phalanx.compat.horovodrun import main\nsys.exit(main(['-np', '2', 'x']))").stdout
    assert out.strip() == "real ['-np', '2', 'x']"


def test_spark_backend_gives_the_number_of_ranks_and_its_run_options(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyspark")
    from phalanx.errors import InvalidArgumentError
    from phalanx.spark.common.backend import SparkBackend, num_proc_of

    out = io.StringIO()
    backend = SparkBackend(num_proc=3, stdout=out, stderr=out, prefix_output_with_timestamp=True,
                           env={"A": "1", "CUDA_VISIBLE_DEVICES": "0"}, start_timeout=12)
    assert num_proc_of(None, backend) == 3 and num_proc_of(4, None) == 4 and num_proc_of(None, None) is None
    assert backend.ignored == ("prefix_output_with_timestamp",)
    with pytest.raises(InvalidArgumentError, match='At most one of parameters "backend" and "num_proc"'):
        num_proc_of(2, backend)
    with pytest.raises(InvalidArgumentError, match="num_proc=0"):
        SparkBackend(num_proc=0)
    seen: dict[str, Any] = {}
    monkeypatch.setattr("phalanx.spark.api.run", lambda fn, args, kwargs, **opts: seen.update(opts) or [fn(*args)])
    assert backend.run(lambda x: x + 1, (1,), env={"B": "2"}) == [2]
    assert seen["num_proc"] == 3 and seen["env"] == {"A": "1", "B": "2"}
    assert (seen["stdout"], seen["start_timeout"]) == (out, 12)
