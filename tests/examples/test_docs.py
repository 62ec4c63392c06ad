"""The reference documentation matches the code: docs/api.md is what tools/gen_api.py writes today, and
docs/env.md what tools/gen_env.py writes, and every public name and every environment variable is documented.
No processes."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
from example_helpers import REPO

from phalanx.env import names

API = REPO / "docs" / "api.md"
ENV = REPO / "docs" / "env.md"


DOCUMENTED = ("phalanx.torch", "phalanx.spark", "phalanx.spark.torch", "phalanx.spark.lightning", "phalanx.spark.keras",
              "phalanx.tensorflow.keras", "phalanx.lightning")


@pytest.mark.parametrize("module_name", DOCUMENTED)
def test_every_public_name_has_an_api_entry(module_name: str) -> None:
    text = API.read_text(encoding="utf-8")
    module = importlib.import_module(module_name)
    missing = [n for n in module.__all__ if f"### `{module_name}.{n}`" not in text]
    assert not missing, f"docs/api.md lacks {missing}: run .venv/bin/python tools/gen_api.py"


def test_run_has_an_api_entry() -> None:
    assert "### `phalanx.run`" in API.read_text(encoding="utf-8")


@pytest.mark.parametrize(("tool", "doc"), [("gen_api", API), ("gen_env", ENV)], ids=["api.md", "env.md"])
def test_generated_docs_match_their_generator(tool: str, doc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/api.md comes from the code's docstrings, docs/env.md from phalanx.env.settings."""
    monkeypatch.syspath_prepend(REPO / "tools")  # the generators import their shared part, tools/_gen.py
    spec = importlib.util.spec_from_file_location(tool, REPO / "tools" / f"{tool}.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.render() == doc.read_text(encoding="utf-8"), (
        f"docs/{doc.name} is out of date: run .venv/bin/python tools/{tool}.py")


def test_every_environment_variable_is_documented() -> None:
    text = ENV.read_text(encoding="utf-8")
    variables = [v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)]
    assert len(variables) > 30
    missing = [v for v in variables if not re.search(rf"`{v}`", text)]
    assert not missing, f"docs/env.md does not document {missing}"


def test_every_example_is_listed_in_the_readme_and_run_by_a_test() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    # Examples that need a shared Spark Connect session are run next to the other Connect tests.
    connect = REPO / "tests" / "spark" / "test_spark_connect.py"
    test_files = [*(REPO / "tests" / "examples").glob("test_examples_*.py"), connect]
    tests = "".join(p.read_text(encoding="utf-8") for p in test_files)
    examples = [p for p in (REPO / "examples").glob("*.py") if p.stem not in ("_digits", "demo")]
    assert len(examples) >= 7
    unlisted = [p.name for p in examples if f"examples/{p.name}" not in readme]
    untested = [p.stem for p in examples if p.stem not in tests]
    assert not unlisted, f"README.md's examples table lacks {unlisted}"
    assert not untested, f"no test in tests/examples (or the Connect tests) runs {untested}"
    mentioned = set(re.findall(r"examples/(\w+\.py)", readme))
    assert not [m for m in mentioned if not (REPO / "examples" / m).is_file()], "README names a missing example"
