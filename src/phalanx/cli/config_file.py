"""``phalanxrun --config-file``: horovodrun's YAML file of tunable parameters.

The file's sections and keys are horovodrun's (``params``, ``autotune``, ``timeline``, ``stall_check``,
``library_options``, ``logging`` and ``controller``). A value fills a flag only where the command line left
it unset: flags given on the command line win, as in horovodrun. The file is read with
``yaml.safe_load`` (no object construction); an unknown section or key is an error naming it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from phalanx.errors import InvalidArgumentError

#: section -> {key in the file: argparse dest}
SECTIONS: dict[str, dict[str, str]] = {
    "params": {k: k for k in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "hierarchical_allreduce",
                              "hierarchical_allgather", "torus_allreduce")},
    "autotune": {"enabled": "autotune", **{k: f"autotune_{k}" for k in (
        "log_file", "warmup_samples", "steps_per_sample", "bayes_opt_max_samples", "gaussian_process_noise")}},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "no_stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {k: k for k in ("mpi_threads_disable", "num_nccl_streams", "thread_affinity",
                                       "gloo_timeout_seconds")},
    "logging": {"level": "log_level", "with_timestamp": "log_with_timestamp"},
}
_TYPES: dict[str, type | tuple[type, ...]] = {
    "timeline_filename": str, "autotune_log_file": str, "log_level": str, "cycle_time_ms": (int, float),
    "autotune_gaussian_process_noise": (int, float),
}


def load(path: str) -> Mapping[str, Any]:
    """Read the YAML file.

    Raises:
        InvalidArgumentError: PyYAML is missing, the file cannot be read, or it is not a YAML mapping.
    """
    try:
        import yaml
    except ImportError as e:
        raise InvalidArgumentError("--config-file needs PyYAML: pip install 'phalanx[config]'") from e
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise InvalidArgumentError(f"--config-file {path!r} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise InvalidArgumentError(f"--config-file {path!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise InvalidArgumentError(f"--config-file {path!r} must hold a mapping of sections; got {type(data).__name__}")
    return data


def _value(path: str, where: str, dest: str, value: object) -> object:
    """Check one value's type (a switch is a bool, a count an int...)."""
    expected = _TYPES.get(dest, bool if dest in _SWITCHES else int)
    if (isinstance(value, bool) and expected is not bool) or not isinstance(value, expected):
        raise InvalidArgumentError(f"--config-file {path!r}: {where} must be {_type_name(expected)}; got {value!r}")
    if dest == "log_level":
        return str(value).upper()
    return (not value) if dest == "no_stall_check" else value


_SWITCHES = {"hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "autotune",
             "timeline_mark_cycles", "no_stall_check", "mpi_threads_disable", "log_with_timestamp"}


def _type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def apply(ns: argparse.Namespace, path: str) -> None:
    """Fill the flags the command line left unset (None) from the file at ``path``.

    Raises:
        InvalidArgumentError: an unknown section or key, a value of the wrong type, or an unknown controller.
    """
    data = load(path)
    for section, body in data.items():
        if section == "controller":
            _controller(ns, path, body)
            continue
        keys = SECTIONS.get(section)
        if keys is None:
            raise InvalidArgumentError(f"--config-file {path!r}: unknown section {section!r}; "
                                       f"horovodrun's are {sorted([*SECTIONS, 'controller'])}")
        if not isinstance(body, Mapping):
            raise InvalidArgumentError(f"--config-file {path!r}: section {section!r} must be a mapping")
        for key, value in body.items():
            dest = keys.get(key)
            if dest is None:
                raise InvalidArgumentError(
                    f"--config-file {path!r}: unknown key {section}.{key}; known: {sorted(keys)}")
            if getattr(ns, dest, None) is None and value is not None:
                setattr(ns, dest, _value(path, f"{section}.{key}", dest, value))


def _controller(ns: argparse.Namespace, path: str, value: object) -> None:
    name = str(value).lower()
    if name not in ("gloo", "mpi"):
        raise InvalidArgumentError(f"--config-file {path!r}: controller {value!r} is not gloo or mpi")
    if name == "mpi" and not ns.gloo and ns.use_mpi is None:
        ns.use_mpi = True
