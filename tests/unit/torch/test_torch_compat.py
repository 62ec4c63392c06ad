"""The horovod / sparkdl aliases, in fresh interpreters (the .pth hook is what a user's process runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _python(code: str, cwd: Path | None = None, extra_path: Path | None = None) -> str:
    env_path = [str(extra_path)] if extra_path else []
    prelude = f"import sys; sys.path[:0] = {env_path!r}\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120,
                          cwd=cwd, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_finder_aliases_modules_without_copies() -> None:
    out = _python(
        "import phalanx.compat as c; c.install(); c.install()\n"
        "import horovod, horovod.torch as hvd, horovod.torch.mpi_ops as m, phalanx.torch, phalanx as api\n"
        "import phalanx.torch.mpi_ops as pm, phalanx.compat.horovod_run as hr\n"
        "print(hvd is phalanx.torch, m is pm, horovod.run is hr.run, hvd.__spec__.name,\n"
        "      sum(type(f).__name__ == 'AliasFinder' for f in sys.meta_path), horovod.__version__,\n"
        "      api.__version__ == api.HOROVOD_API_VERSION)"
    )
    assert out == "True True True phalanx.torch 1 0.28.1 False"  # Horovod's API version, phalanx's own apart


def test_pth_hook_makes_unchanged_horovod_imports_work() -> None:
    pth = [p for p in map(Path, sys.path) if (p / "phalanx-compat.pth").exists()]
    if not pth:
        pytest.skip("phalanx is not pip-installed in this interpreter (no phalanx-compat.pth on sys.path)")
    lazy = _python("print(any(getattr(f, '__name__', '') == 'PhalanxLazyAliasHook' for f in sys.meta_path), "
                   "'phalanx' in sys.modules)")
    assert lazy == "True False"  # start-up registers the inline hook and imports nothing
    out = _python("import horovod.torch as hvd; hvd.init(); print(hvd.size(), hvd.rank(), type(hvd.Average))")
    assert out == "1 0 <class 'int'>"


def test_spark_aliases_resolve_lazily() -> None:
    out = _python(
        "import phalanx.compat as c; c.install()\n"
        "import sparkdl, sparkdl.horovod, horovod.spark, phalanx.spark\n"
        "print(horovod.spark is phalanx.spark, 'pyspark' in sys.modules)\n"
        "print(sparkdl.HorovodRunner.__name__, sparkdl.horovod.log_to_driver.__name__)"
    )
    assert out.splitlines()[0] == "True False"
    assert out.splitlines()[1] == "HorovodRunner log_to_driver"


def test_real_package_wins(tmp_path: Path) -> None:
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "horovod" / "torch.py").write_text("REAL_TORCH = True\n")
    out = _python(
        "import phalanx.compat as c; c.install()\nimport horovod, horovod.torch\n"
        "print(getattr(horovod, 'REAL', False), getattr(horovod.torch, 'REAL_TORCH', False))",
        extra_path=tmp_path,
    )
    assert out == "True True"


def test_unknown_names_are_not_aliased() -> None:
    out = _python(
        "import phalanx.compat as c; c.install()\n"
        "try:\n    import horovod.mxnet\nexcept ImportError as e:\n    print('ImportError')\n"
        "c.uninstall(); print(c.installed())"
    )
    assert out == "ImportError\nFalse"


def test_petastorm_names_resolve_to_the_converter_through_the_start_up_hook() -> None:
    """Petastorm's converter imports, unchanged, where Petastorm is absent (the .pth hook's lazy finder)."""
    out = _python(
        "from petastorm.spark import make_spark_converter, SparkDatasetConverter\n"
        "from petastorm import TransformSpec\nfrom petastorm.pytorch import DataLoader\n"
        "import phalanx.spark.converter as c, phalanx.spark.loader as l\n"
        "print(make_spark_converter is c.make_spark_converter, SparkDatasetConverter is c.SparkDatasetConverter,\n"
        "      TransformSpec.__module__, DataLoader is l.DataLoader, 'pyspark' in sys.modules)")
    if "No module named 'petastorm'" in out:
        pytest.skip("phalanx is not pip-installed in this interpreter (no phalanx-compat.pth)")
    assert out == "True True phalanx.spark.transform True False"
