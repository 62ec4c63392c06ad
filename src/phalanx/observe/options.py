"""What a job's user asked to see: the live page (where it listens) and MLflow logging, validated up front."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from phalanx.env import names as env_names
from phalanx.env import settings
from phalanx.errors import InvalidArgumentError

#: Seconds between two stats records of a rank while the job is observed (the page updates every second).
STATS_INTERVAL_S = 1.0
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ObserveOptions:
    """How a job is observed; None of it (no options at all) when the user asked for nothing.

    Attributes:
        dashboard: ``(host, port)`` the page listens on (port 0: a free one), or None: no page.
        mlflow: log the job's metrics and timeline summary to the driver's active MLflow run.
    """

    dashboard: tuple[str, int] | None = None
    mlflow: bool = False

    def rank_env(self) -> dict[str, str]:
        """What every rank needs in its environment: the stats records' interval."""
        return {env_names.PHALANX_STATS_INTERVAL_S: f"{STATS_INTERVAL_S:g}"}


def parse_dashboard(value: object, name: str = "dashboard") -> tuple[str, int] | None:
    """``True``/``"1"`` -> a free port on loopback; a port (int or text); ``"HOST:PORT"``; ``False``/``0``/
    ``None``/``"0"`` -> no page.

    Raises:
        InvalidArgumentError: not one of those, a port outside 0-65535, or a host that is not an address or name.
    """
    if value is None or value is False or value == 0 or value == "0" or value == "":
        return None
    if value is True or value == "1":
        return LOOPBACK, 0
    if isinstance(value, int) and not isinstance(value, bool):
        return LOOPBACK, _port(str(value), name)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be True, a port or 'HOST:PORT'; got {value!r}")
    host, sep, port = value.strip().rpartition(":")
    if not sep:
        return LOOPBACK, _port(port, name)
    return _host(host.strip("[]"), name), _port(port, name)


def _port(text: str, name: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise InvalidArgumentError(f"{name}: {text!r} is not a port (0-65535; 0: a free one)")
    return int(text)


def _host(host: str, name: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise InvalidArgumentError(f"{name}: host {host!r} does not resolve ({e}); give an address such as "
                                   "127.0.0.1 or 0.0.0.0") from e
    return host


def resolve(dashboard: object = None, mlflow: bool | None = None,
            environ: Mapping[str, str] | None = None) -> ObserveOptions | None:
    """The job's options from the entry point's arguments, else ``PHALANX_DASHBOARD`` / ``PHALANX_MLFLOW``;
    None when neither asks for anything.

    Raises:
        InvalidArgumentError: a bad ``dashboard`` value, or ``mlflow`` asked for where it is not installed.
        SettingError: a bad variable.
    """
    where = (parse_dashboard(dashboard) if dashboard is not None
             else parse_dashboard(settings.DASHBOARD.get(environ), env_names.PHALANX_DASHBOARD))
    log = settings.MLFLOW.get(environ) if mlflow is None else bool(mlflow)
    if log:
        _check_mlflow()
    if where is None and not log:
        return None
    return ObserveOptions(dashboard=where, mlflow=log)


def _check_mlflow() -> None:
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        raise InvalidArgumentError("mlflow=True (PHALANX_MLFLOW=1) needs the mlflow package on the driver: "
                                   "pip install mlflow, or leave MLflow logging off")
