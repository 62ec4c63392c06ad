"""The environment: every variable phalanx reads or writes, named and parsed in one place.

- :mod:`phalanx.env.names`: every variable's name, once;
- :mod:`phalanx.env.settings`: every setting phalanx reads, with its type, default, parser and error
  (``SettingError``), under one truth rule (unset or empty means the default);
- :mod:`phalanx.env.contract`: the worker contract, pure functions from (job, rank) to ``dict[str, str]``;
- :mod:`phalanx.env.catalog`: docs/env.md's tables (``tools/gen_env.py`` writes the page from it);
- :mod:`phalanx.env.rounds`, :mod:`phalanx.env.foreign`, :mod:`phalanx.env.shm`: the store keys of an elastic
  job's rounds, other launchers' rank variables, the transport's file names.
"""

from __future__ import annotations

from phalanx.env import names, rounds, settings
from phalanx.env.contract import (
    DEFAULT_START_TIMEOUT_S,
    JobContract,
    RankIdentity,
    WorkerContract,
    assign_ranks,
    compose_env,
    read_contract,
    worker_env,
)

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "JobContract",
    "RankIdentity",
    "WorkerContract",
    "assign_ranks",
    "compose_env",
    "names",
    "read_contract",
    "rounds",
    "settings",
    "worker_env",
]
