"""Fixtures for the timeline tests: a clean environment and no timeline left running."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from phalanx import timeline
from phalanx.env import names as env_names


@pytest.fixture(autouse=True)
def clean_timeline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Unset every variable the timeline reads and stop any timeline a test leaves running."""
    for name in (
        env_names.RANK,
        env_names.WORLD_SIZE,
        env_names.HOROVOD_TIMELINE,
        env_names.HOROVOD_TIMELINE_MARK_CYCLES,
        env_names.PHALANX_TIMELINE_ALL_RANKS,
        env_names.PHALANX_TIMELINE_MAX_MB,
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    timeline.stop_timeline()
