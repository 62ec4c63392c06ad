"""What a shared template accepts from a connection: a checked spawn request, nothing else."""

from __future__ import annotations

import json

import pytest

from phalanx.worker.template_shared import spawn_request

GOOD = {"spawn": 3, "env": {"A": "1", "PATH": "/bin"}, "cwd": "/tmp", "python": None}


def test_a_well_formed_request_is_accepted() -> None:
    assert spawn_request(json.dumps(GOOD).encode()) == GOOD
    assert spawn_request(json.dumps({k: v for k, v in GOOD.items() if k != "python"}).encode()) == GOOD


@pytest.mark.parametrize("change, named", [
    ({"python": {"kind": "path", "target": "/tmp/x.py", "args": [], "argv": []}}, "never a command"),
    ({"cwd": "relative/dir"}, "absolute"),
    ({"cwd": 7}, "absolute"),
    ({"env": {"A": 1}}, "environment"),
    ({"env": {"A=B": "1"}}, "environment"),
    ({"env": {"A": "x\0y"}}, "environment"),
    ({"env": ["A"]}, "environment"),
    ({"spawn": "3"}, "integer"),
    ({"spawn": True}, "integer"),
    ({"argv": ["sh", "-c", "id"]}, "not a spawn request"),
])
def test_anything_else_is_refused_naming_why(change: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        spawn_request(json.dumps({**GOOD, **change}).encode())


def test_a_request_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ValueError, match="not a spawn request"):
        spawn_request(b"[1, 2]")
