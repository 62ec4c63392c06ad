"""What the doc generators (``gen_api.py``, ``gen_env.py``) share: write a generated page, or check it.

A generator imports this module as ``_gen``: run as a script, its folder is on ``sys.path``; a test that
loads a generator by its file path puts ``tools/`` there first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(tool: str, doc: Path, render: Callable[[], str], description: str, argv: list[str] | None = None) -> int:
    """Rewrite ``doc`` with ``render()``, or with ``--check`` exit 1 when it differs.

    Args:
        tool: the generator's file (its ``__file__``), named in the hint to run it.
        doc: the generated page.
        render: the page's text as the code describes it today.
        description: the ``--help`` text (the generator's docstring).
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, or 1 when ``--check`` found the page out of date.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    page = doc.relative_to(REPO)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {page} is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if doc.read_text(encoding="utf-8") != text:
            hint = Path(tool).resolve().relative_to(REPO)
            print(f"{page} is out of date: run .venv/bin/python {hint}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(text, encoding="utf-8")
    print(f"wrote {page}")
    return 0
