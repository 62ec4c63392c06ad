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


# What the prose documents names must exist: a path of phalanx's own tree, and in docs/design.md (the code as
# built) every class-like name and every `module/path.name` reference. Text only: no imports, no processes.
PROSE = sorted([*(REPO / "docs").glob("*.md"), REPO / "README.md"])
SRC = REPO / "src" / "phalanx"
LAYER_DIRS = "cli|compat|env|job|launch|lightning|observe|spark|tensorflow|timeline|torch|transport|worker"
OWN_PATH = re.compile(rf"(?<![\w./-])((?:src/phalanx/|phalanx/)?(?:{LAYER_DIRS})/[a-z0-9_/]*\.py"
                      r"|(?:tests|tools|bench|examples|docs)/[a-z0-9_/]*\.(?:py|md))(?![\w/])")
# `torch/_engine/core.step_parked`, `job/store_client.StoreClient`: a module of src/phalanx and a name in it.
MODULE_NAME = re.compile(rf"`((?:{LAYER_DIRS})(?:/\w+)+)\.(?!py`)(\w+)`")
CLASS_LIKE = re.compile(r"`(_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)\b")  # not an ALL_CAPS constant
# Names design.md takes from torch, Lightning, the standard library or another project.
# (HorovodStrategy is built per Lightning flavour at run time.)
FOREIGN = {"KeyboardInterrupt", "Popen", "PContext", "Work", "TCPStore", "PrefixStore", "Trainer", "ParallelStrategy",
           "_AcceleratorConnector", "_Launcher", "HorovodStrategy"}


def _own_file(token: str) -> Path:
    rel = token.removeprefix("src/phalanx/").removeprefix("phalanx/")
    layer = rel.split("/", 1)[0]
    return SRC / rel if layer in LAYER_DIRS.split("|") else REPO / rel


DEFINITION = re.compile(r"^[ \t]*(?:(?:async[ \t]+)?(?:class|def)[ \t]+(\w+)|(\w+)[ \t]*(?::[^=\n]*)?=)", re.MULTILINE)


def _names(text: str) -> set[str]:
    """The names a module's text defines: classes, functions, assigned names (at any indentation)."""
    return {a or b for a, b in DEFINITION.findall(text)}


def _defined(text: str, name: str) -> bool:
    return name in _names(text)


@pytest.mark.parametrize("doc", PROSE, ids=lambda p: p.name)
def test_paths_the_docs_name_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = sorted({m for m in OWN_PATH.findall(text) if not _own_file(m).exists()})
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_design_md_names_what_the_code_defines() -> None:
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    sources = {p: _names(p.read_text(encoding="utf-8")) for p in SRC.rglob("*.py")}
    everything = set().union(*sources.values())
    unknown = sorted({n for n in CLASS_LIKE.findall(text) if n not in FOREIGN and n not in everything})
    assert not unknown, f"docs/design.md names classes or functions the code does not define: {unknown}"
    wrong = sorted({f"{m}.{n}" for m, n in MODULE_NAME.findall(text)
                    if n not in sources.get(SRC / f"{m}.py", set())})
    assert not wrong, f"docs/design.md places names in modules that do not define them: {wrong}"


def test_the_docs_checks_see_what_design_md_names() -> None:
    """The patterns above still match the way design.md writes paths and names (else the checks pass on nothing)."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    assert len(set(OWN_PATH.findall(text))) > 60
    assert {"JobDriver", "RankStarter", "Elasticity"} <= set(CLASS_LIKE.findall(text))
    assert ("job/store_client", "StoreClient") in MODULE_NAME.findall(text)
    assert not _defined("class JobDriverX:\n", "JobDriver")
    assert _defined("    RUNTIME: Runtime = Runtime()\n", "RUNTIME")


def test_design_md_layer_table_lists_existing_modules() -> None:
    """The layer table names each layer's modules relative to the layer's folder (`launch/` ... `core.py`)."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w/]+)/`[^|]*\| (.*?) \|", text, re.MULTILINE)
    assert len(rows) >= 10
    missing = sorted({f"{layer}/{name}" for layer, cell in rows for name in re.findall(r"`(\w+\.py)`", cell)
                      if not (SRC / layer / name).exists()})
    assert not missing, f"docs/design.md's layer table names modules that do not exist: {missing}"
