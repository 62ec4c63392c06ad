"""Fixtures shared by the unit tier."""

from __future__ import annotations

import pytest

from phalanx.env import names as env_names


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's variables in the environment: ``hvd.init()`` then makes a one-rank job on a private
    in-process store."""
    for name in (env_names.MASTER_ADDR, env_names.MASTER_PORT, env_names.RANK, env_names.WORLD_SIZE,
                 env_names.LOCAL_RANK, env_names.HOROVOD_RANK):
        monkeypatch.delenv(name, raising=False)
