"""``DeepspeedTorchDistributor``: pyspark's API (``pyspark.ml.deepspeed.deepspeed_distributor``) on phalanx's
launchers.

pyspark's runs ``torchrun ... train.py ARGS --deepspeed [--deepspeed_config PATH]`` (a function runs through a
generated script the same way), with ``numGpus * nnodes`` processes: all on the driver in local mode, one per
Spark task otherwise, or ``k`` per task when each holds ``k`` GPUs (``spark.task.resource.gpu.amount``). Here
the same ranks run on :class:`~phalanx.spark.distributor.TorchDistributor` (``k`` per task likewise, each
pinned to one of its task's GPUs), and every rank sees the same command line: a
script runs with ``ARGS --deepspeed [--deepspeed_config PATH]`` as its ``sys.argv``, a function runs with
``sys.argv[1:]`` set to the flags. The configuration (a dict, or a JSON file read on the driver) travels with
the job and each rank writes it to a private file of its own, so a path need not exist on the executors, and a
bad one fails on the driver before anything starts. No ssh keys or pdsh: ranks start as Spark tasks.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast, overload

from phalanx.errors import InvalidArgumentError, SlotsUnavailableError
from phalanx.launch.api import validate_np
from phalanx.spark.distributor import R, TorchDistributor, script_command

DEEPSPEED_FLAG = "--deepspeed"
CONFIG_FLAG = "--deepspeed_config"
CONFIG_NAME = "deepspeed_config.json"


def config_text(config: object) -> str | None:
    """``deepspeedConfig`` as the JSON text the ranks get (None: DeepSpeed's defaults).

    Raises:
        InvalidArgumentError: a path that is not a readable JSON file, a dict JSON cannot hold, another type.
    """
    if config is None:
        return None
    if isinstance(config, dict):
        try:
            return json.dumps(config)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"deepspeedConfig dict cannot be written as JSON: {e}; give plain values "
                                       "(str, int, float, bool, None, lists and dicts of them)") from e
    if isinstance(config, str | os.PathLike):
        return _read_config(Path(config))
    raise InvalidArgumentError(f"deepspeedConfig must be a dict, the path of a JSON file or None; got "
                               f"{type(config).__name__} {config!r}")


def _read_config(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidArgumentError(f"deepspeedConfig {str(path)!r} cannot be read on the driver: {e.strerror}; "
                                   "give the path of a DeepSpeed JSON config, or a dict") from e
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(f"deepspeedConfig {str(path)!r} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"deepspeedConfig {str(path)!r} holds a JSON {type(value).__name__}, not an "
                                   "object of DeepSpeed settings")
    return text


@contextlib.contextmanager
def _config_file(text: str | None) -> Iterator[list[str]]:
    """The DeepSpeed flags for this rank, with ``text`` in a private file that lives as long as the block."""
    if text is None:
        yield [DEEPSPEED_FLAG]
        return
    directory = tempfile.mkdtemp(prefix="phalanx-deepspeed-")
    try:
        path = os.path.join(directory, CONFIG_NAME)
        with open(path, "x", encoding="utf-8") as f:
            f.write(text)
        yield [DEEPSPEED_FLAG, CONFIG_FLAG, path]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _argv(argv: list[str], path_first: str | None = None) -> Iterator[None]:
    """``sys.argv`` (and ``path_first`` first on ``sys.path``, as ``python script`` puts its directory) for the
    length of the block."""
    saved, saved_path = sys.argv, list(sys.path)
    sys.argv = argv
    if path_first is not None:
        sys.path.insert(0, path_first)
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved, saved_path


@dataclass(frozen=True)
class DeepSpeedCall:
    """What every rank runs: the user's function or script with pyspark's DeepSpeed flags in ``sys.argv``.

    Attributes:
        target: the function, or the absolute path of the script.
        args: the function's arguments, or the script's command-line arguments (strings).
        kwargs: the function's keyword arguments.
        config: the DeepSpeed config as JSON text; None for DeepSpeed's defaults (then only ``--deepspeed``).
    """

    target: Callable[..., object] | str
    args: tuple[object, ...] = ()
    kwargs: dict[str, object] = field(default_factory=dict)
    config: str | None = None

    def __call__(self) -> object:
        with _config_file(self.config) as flags:
            if isinstance(self.target, str):
                with _argv([self.target, *map(str, self.args), *flags], os.path.dirname(self.target)):
                    runpy.run_path(self.target, run_name="__main__")
                return None
            with _argv([sys.argv[0] if sys.argv else "", *flags]):
                return self.target(*self.args, **self.kwargs)


class DeepspeedTorchDistributor(TorchDistributor):
    """Run a DeepSpeed training function or script on ``numGpus * nnodes`` ranks (pyspark's signature).

    Args:
        numGpus: GPUs (ranks) per node, as ``deepspeed --num_gpus``.
        nnodes: nodes. In local mode all ``numGpus * nnodes`` ranks run on the driver; on the cluster each
            Spark task runs one rank, or, with ``useGpu`` and ``spark.task.resource.gpu.amount=k`` GPUs per task,
            ``k`` ranks (one per GPU; ``numGpus * nnodes`` must be a multiple of ``k``), as pyspark's does: with
            ``k = numGpus``, one task per node.
        localMode: True: on the driver (no Spark job); False: on the cluster's executors.
        useGpu: give each rank GPUs as :class:`TorchDistributor` does (an error when there are none).
        deepspeedConfig: a dict of DeepSpeed settings, the path of a JSON file of them (read on the driver), or
            None (DeepSpeed's defaults: the ranks get ``--deepspeed`` alone).

    Raises:
        InvalidArgumentError: ``numGpus``/``nnodes`` not positive ints; a ``deepspeedConfig`` path that does not
            exist or is not JSON; a dict JSON cannot hold.
    """

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True, useGpu: bool = True,
                 deepspeedConfig: str | os.PathLike[str] | dict[str, object] | None = None) -> None:
        self.num_gpus = validate_np(numGpus, "numGpus")
        self.nnodes = validate_np(nnodes, "nnodes")
        self.deepspeed_config = deepspeedConfig
        self._config = config_text(deepspeedConfig)
        super().__init__(self.num_gpus * self.nnodes, localMode, useGpu)

    # pyspark's DeepspeedTorchDistributor returns None for a script, where TorchDistributor returns its
    # stdout: not a substitute there, hence the ignores.
    @overload  # type: ignore[override]
    def run(self, train_object: Callable[..., R], *args: object, **kwargs: object) -> R: ...

    @overload
    def run(self, train_object: str | os.PathLike[str], *args: object, **kwargs: object) -> None: ...

    def run(self, train_object: Callable[..., R] | str | os.PathLike[str], *args: object, **kwargs: object,
            ) -> R | None:
        """Run ``train_object`` on every rank with ``--deepspeed [--deepspeed_config PATH]`` in ``sys.argv``.

        Args:
            train_object: a function (called with ``*args, **kwargs``) or the path of a Python script (run
                as ``__main__`` with ``sys.argv = [script, *args, "--deepspeed", ...]``; it must exist on the
                executors too).
            args: arguments of the function, or command-line arguments of the script.
            kwargs: keyword arguments of the function.

        Returns:
            A function's return value on rank 0; None for a script (as pyspark's).

        Raises:
            InvalidArgumentError: a bad argument, ``useGpu=True`` without GPUs, ``numGpus * nnodes`` not a
                multiple of the GPUs per task.
            WorkerFailedError: a rank failed (the root cause first).
            SlotsUnavailableError: the cluster cannot run the ranks' tasks at once.
        """
        if isinstance(train_object, str | os.PathLike):
            if kwargs:
                raise InvalidArgumentError(f"a script takes no keyword arguments; got {sorted(kwargs)}")
            script, *argv = script_command(os.fspath(train_object), args)
            call = DeepSpeedCall(script, tuple(argv), {}, self._config)
        elif callable(train_object):
            call = DeepSpeedCall(train_object, args, kwargs, self._config)
        else:
            raise InvalidArgumentError(f"train_object must be a function or a script path; got {train_object!r}")
        try:
            return cast("R | None", super().run(call))  # rank 0's return of the function; None for a script
        except (SlotsUnavailableError, InvalidArgumentError) as e:  # the checks before launch, in num_processes
            raise type(e)(f"DeepspeedTorchDistributor(numGpus={self.num_gpus}, nnodes={self.nnodes}) runs "
                          f"num_processes={self.num_processes} ranks: {e}") from e
