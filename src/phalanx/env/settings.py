"""Every setting phalanx reads from the environment: its name, type, default, unit, parser and error.

Ray Train's ``constants.py`` is the model: each knob is one named :class:`Setting`; code that needs a value
calls ``SETTING.get()`` (or ``SETTING.get(environ)`` for an environment that is not this process's) and
never parses a variable itself. ``tools/gen_env.py`` writes ``docs/env.md`` from these objects.

One truth rule holds for every setting: a variable that is unset, empty or only blanks takes its default
(``PHALANX_SHM=`` is the same as no ``PHALANX_SHM``). A bool is true for ``1``/``true``/``yes``/``on`` and
false for ``0``/``false``/``no``/``off`` (any case). Any other value raises :class:`SettingError` naming
the variable, the value and what it must be, before anything is started with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from phalanx.env import names
from phalanx.env.rounds import DEFAULT_ELASTIC_TIMEOUT_S
from phalanx.errors import SettingError

T = TypeVar("T")

#: Seconds every rank has to start and reach the driver's channel, unless set otherwise.
DEFAULT_START_TIMEOUT_S = 30.0
DEFAULT_SPARK_START_TIMEOUT_S = 600.0  # horovod.spark.run's default
#: Seconds between SIGTERM and SIGKILL when a job is torn down, unless PHALANX_TEARDOWN_GRACE_S.
DEFAULT_TEARDOWN_GRACE_S = 3.0

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
#: Horovod's log level names (``HOROVOD_LOG_LEVEL``), any case.
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class ParseError(ValueError):
    """What a parser says is wrong with a value; :meth:`Setting.get` turns it into a :class:`SettingError`."""


def boolean(raw: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case)."""
    word = raw.lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ParseError("is not a boolean: use 1/true/yes/on or 0/false/no/off")


def text(raw: str) -> str:
    """The value as written (blanks at either end removed)."""
    return raw


def integer(raw: str) -> int:
    """A whole number."""
    try:
        return int(raw)
    except ValueError as e:
        raise ParseError("is not an integer") from e


def number(unit: str, minimum: float = float("-inf"), positive: bool = False) -> Callable[[str], float]:
    """A parser of decimal numbers of ``unit`` (``>= minimum``; ``> 0`` when ``positive``)."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError as e:
            raise ParseError(f"is not a number of {unit}") from e
        if positive and value <= 0:
            raise ParseError(f"must be a positive number of {unit}")
        if value < minimum:
            raise ParseError(f"must be >= {minimum:g} {unit}")
        return value

    return parse


def byte_count(raw: str) -> int:
    """A positive number of bytes (``2097152`` or ``2e6``)."""
    return int(number("bytes", positive=True)(raw))


def auto_bool(raw: str) -> str:
    """``auto`` (any case), else a boolean as :func:`boolean` reads it: ``"auto"``, ``"always"`` or ``"never"``."""
    if raw.lower() == "auto":
        return "auto"
    try:
        return "always" if boolean(raw) else "never"
    except ParseError as e:
        raise ParseError("is not auto or a boolean (1/true/yes/on, 0/false/no/off)") from e


def level(raw: str) -> str:
    """One of :data:`LOG_LEVELS` (any case), upper-cased."""
    if raw.upper() not in LOG_LEVELS:
        raise ParseError(f"is not one of {list(LOG_LEVELS)}")
    return raw.upper()


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable phalanx reads.

    Attributes:
        name: the variable.
        default: the value when it is unset or empty.
        parse: text (stripped, non-empty) -> value; raises :class:`ParseError`.
        unit: what the value is (``bool``, ``seconds``, ``path``...), for docs/env.md.
        shown_default: the default as docs/env.md shows it.
        read_by: where it takes effect, for docs/env.md.
        effect: what it does, for docs/env.md.
    """

    name: str
    default: T
    parse: Callable[[str], T]
    unit: str
    shown_default: str
    read_by: str
    effect: str

    @property
    def title(self) -> str:
        """The variable as docs/env.md's tables show it."""
        return f"`{self.name}`"

    def raw(self, environ: Mapping[str, str] | None = None) -> str:
        """The variable's text, stripped; ``""`` when unset."""
        return (os.environ if environ is None else environ).get(self.name, "").strip()

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable has a value (not unset, not empty)."""
        return bool(self.raw(environ))

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (default: this process's environment).

        Raises:
            SettingError: the value cannot be parsed (the message names the variable, the value and the fix).
        """
        raw = self.raw(environ)
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ParseError as e:
            raise SettingError(f"{self.name}={raw!r} {e}; fix or unset it") from e


def first_int(environ: Mapping[str, str], *variables: str, default: int) -> int:
    """The first of ``variables`` that has a value, as an integer (the worker contract's rank variables, read
    under several launchers' names: ``RANK`` or ``HOROVOD_RANK``...), else ``default``. Same truth rule:
    empty or blank is unset.

    Raises:
        SettingError: that variable is not an integer.
    """
    for name in variables:
        raw = environ.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError as e:
                raise SettingError(f"{name}={raw!r} is not an integer; fix the launcher's environment") from e
    return default


def _bool(name: str, default: bool, read_by: str, effect: str) -> Setting[bool]:
    return Setting(name, default, boolean, "bool", "`1`" if default else "`0`", read_by, effect)


def _seconds(name: str, default: float, read_by: str, effect: str, shown: str = "", *,
             positive: bool = True) -> Setting[float]:
    parse = number("seconds", positive=positive, minimum=0.0)
    return Setting(name, default, parse, "seconds", shown or f"`{default:g}`", read_by, effect)


def _maybe_seconds(name: str, shown: str, read_by: str, effect: str, *, positive: bool) -> Setting[float | None]:
    parse: Callable[[str], float | None] = number("seconds", positive=positive, minimum=0.0)
    return Setting(name, None, parse, "seconds", shown, read_by, effect)


def _text(name: str, unit: str, shown: str, read_by: str, effect: str) -> Setting[str]:
    return Setting(name, "", text, unit, shown, read_by, effect)


EVERY_RANK = "`hvd.init()` (each rank)"
TRANSPORT = "shared-memory transport"


# --- the worker contract: set by every phalanx launcher, read in the ranks (shown_default: an example).
RUN_ID = _text(names.PHALANX_RUN_ID, "id", "`phalanx-f259f872600e`", "ranks",
               "the job's id (same as `TORCHELASTIC_RUN_ID`)")
CHANNEL = _text(names.PHALANX_CHANNEL, "host:port", "`127.0.0.1:44813`", "ranks",
                "host:port of the driver's channel (results, errors, logs)")
SECRET = _text(names.PHALANX_SECRET, "hex", "(64 hex digits)", "ranks",
               "the per-job secret that authenticates this rank on the channel (HMAC challenge)")
HOSTNAME = _text(names.HOROVOD_HOSTNAME, "host", "`vm`", "ranks",
                 "the host the launcher placed this rank on (ranks are grouped into local ranks by it)")
START_TIMEOUT = _seconds(names.PHALANX_START_TIMEOUT_S, DEFAULT_START_TIMEOUT_S, "ranks",
                         "seconds a rank may take to reach the channel", "`30.0`")
PARENT_PID: Setting[int | None] = Setting(
    names.PHALANX_PARENT_PID, None, integer, "pid", "`26909`", "ranks",
    "pid of the process that started the rank (the driver locally, the barrier task on Spark); the rank "
    "exits when it dies")

# --- set by particular launchers or jobs (read_by: who sets it).
LOG_TO_DRIVER = _bool(names.PHALANX_LOG_TO_DRIVER, False, "`phalanx.spark` tasks",
                      "`1`: `log_to_driver(msg)` sends `msg` on the channel (outside a Spark job it prints to "
                      "stdout)")
ELASTIC_WORKER_ID: Setting[int | None] = Setting(
    names.PHALANX_ELASTIC_WORKER_ID, None, integer, "id", "unset",
    "elastic jobs (`phalanx.run(min_np=...)`, `phalanxrun --min-np`)",
    "the worker's stable id (its channel rank; its torch rank changes from round to round); see "
    "[elastic.md](elastic.md)")
STATS_INTERVAL = _maybe_seconds(
    names.PHALANX_STATS_INTERVAL_S, "unset (off)", "launchers with a live page, metrics or MLflow on",
    "a rank running phalanx.torch sends the driver its steps and collective waits this often (see "
    "[observe.md](observe.md))", positive=True)

# --- knobs a user may set.
HOROVOD_START_TIMEOUT = _seconds(
    names.HOROVOD_START_TIMEOUT, DEFAULT_START_TIMEOUT_S, "driver",
    "how long every rank has to start and reach the channel; `StartTimeoutError` names the ranks that did "
    "not (`phalanx.run(start_timeout=)` and `phalanx.spark.run(start_timeout=)` override it)")
HOROVOD_SPARK_START_TIMEOUT = _seconds(
    names.HOROVOD_SPARK_START_TIMEOUT, DEFAULT_SPARK_START_TIMEOUT_S, "driver",
    "on Spark (`HorovodRunner`, `TorchDistributor`, `phalanx.spark.run`): how long Spark has to schedule the "
    "barrier tasks and every rank to start, as Horovod's `horovod.spark.run`; unset, `HOROVOD_START_TIMEOUT` "
    "applies if set, else 600 (executors started on demand can take minutes)")
FUSION_THRESHOLD: Setting[int | None] = Setting(
    names.HOROVOD_FUSION_THRESHOLD, None, integer, "bytes", "unset: ≤ 128 MiB and ~4 buckets of ≥ 1 MiB",
    "`hvd.DistributedOptimizer`", "the largest gradient bucket (one fused allreduce; values below 1 mean 1); "
    "see [torch.md](torch.md)")
CYCLE_TIME = _text(names.HOROVOD_CYCLE_TIME, "ms", "—", "nothing",
                   "accepted for Horovod compatibility and **ignored**: phalanx has no background cycle; "
                   "buckets launch when full")
TIMELINE = _text(names.HOROVOD_TIMELINE, "path", "unset (off)", "`hvd.init()`",
                 "write a Chrome trace of negotiations, collectives and optimizer buckets (rank 0 writes, as "
                 "in Horovod; `DYNAMIC`: nothing starts until `hvd.start_timeline`); see "
                 "[timeline.md](timeline.md)")
TIMELINE_MARK_CYCLES = _bool(names.HOROVOD_TIMELINE_MARK_CYCLES, False, "`hvd.init()`",
                             "`1`: mark cycle starts in the timeline")
TIMELINE_ALL_RANKS = _bool(names.PHALANX_TIMELINE_ALL_RANKS, False, "`hvd.init()`",
                           "`1`: every rank writes its own trace (path with a `.rankN` suffix), so a straggler "
                           "shows")
TIMELINE_MAX_MB = Setting(names.PHALANX_TIMELINE_MAX_MB, 1024.0, number("megabytes", 0.0),
                          "MB", "`1024`", "timeline writer",
                          "cap of a rank's trace, both rotation segments together (`timeline.json.1` + "
                          "`timeline.json`); `0`: unbounded")
DYNAMIC_PROCESS_SETS = _bool(names.HOROVOD_DYNAMIC_PROCESS_SETS, False, "`hvd.init()`",
                             "`1` on every rank: allow `hvd.add_process_set` / `remove_process_set` after "
                             "`init`")
WARM_START = _bool(names.PHALANX_WARM_START, True, "driver; Spark tasks; host agents",
                   "`0`: start every rank in a fresh interpreter instead of forking it from a template that has "
                   "already imported torch and the function's packages")
SHM = _bool(names.PHALANX_SHM, True, "`hvd.init()`, worker entry (every rank)",
            "`0`: no shared-memory transport between ranks on one host (gloo carries everything, also for "
            "torch-native `init_process_group(\"gloo\")`); must be the same on every rank")
SHM_TIMEOUT = _seconds(names.PHALANX_SHM_TIMEOUT_S, 600.0, TRANSPORT,
                       "how long a rank waits for its peers inside one shared-memory step before it raises "
                       "(phalanx.torch's transport; a `phalanx_shm` group waits as long as its "
                       "`init_process_group(timeout=...)`)")
SHM_SLOT_BYTES = Setting(names.PHALANX_SHM_SLOT_BYTES, 2 * 1024 * 1024, byte_count, "bytes",
                         "`2097152` (2 MiB)", TRANSPORT,
                         "each rank's staging slot (rounded down to a multiple of 64); larger tensors go "
                         "through in chunks of this size")
SHM_NATIVE = _bool(names.PHALANX_SHM_NATIVE, True, "worker entry (every rank)",
                   "`0`: torch-native code (`init_process_group(\"gloo\")`: DDP, FSDP, Lightning) keeps gloo; by "
                   "default a one-host job launched by phalanx gets the `phalanx_shm` backend instead "
                   "(BENCHMARKS.md has its figures; docs/shm.md). `PHALANX_SHM=0` turns it off too")
SHM_CMA = _bool(names.PHALANX_SHM_CMA, True, TRANSPORT,
                "`0`: no cross-memory attach (`process_vm_readv`) for the hierarchical and the optimizer's "
                "in-place allreduces; they stream through the segment (off when any rank sets it)")
SHM_THP = _bool(names.PHALANX_SHM_THP, True, f"{TRANSPORT} (each rank)",
                "`0`: do not advise the 2 MiB blocks of `DistributedOptimizer` gradients that peers read by "
                "cross-memory attach to transparent huge pages (`MADV_HUGEPAGE` + `MADV_COLLAPSE`); see "
                "[shm.md](shm.md)")
SHM_GRAD_ASYNC = _bool(names.PHALANX_SHM_GRAD_ASYNC, False, "`hvd.init()` (every rank)",
                       "`1`: the `DistributedOptimizer`'s shared-memory buckets are reduced on a transport worker "
                       "thread during backward (several buckets) instead of in `step()` (one bucket); off by "
                       "default because it measured slower on the 2-core bench machine (BENCHMARKS.md); must be "
                       "the same on every rank")
SHM_EARLY_REDUCE = _bool(names.PHALANX_SHM_EARLY_REDUCE, True, "`DistributedOptimizer(...)` (each rank)",
                         "`0`: no early reduction: with two ranks on one host, the rank that finished backward "
                         "first reduces the gradients already final on both ranks while it waits for the other "
                         "(see [shm.md](shm.md#early-reduction-the-waiting-rank-reduces-what-is-already-final-2-"
                         "ranks)); a rank that sets it makes both reduce as usual")
TF_DLPACK = Setting(names.PHALANX_TF_DLPACK, "auto", auto_bool, "auto/bool", "`auto`",
                    "`phalanx.tensorflow` collectives (each rank)",
                    "how TensorFlow tensors reach the collectives: `auto` hands a tensor on a GPU over by DLPack "
                    "(its own memory, reduced by NCCL, never copied to the host) and a CPU tensor as a numpy "
                    "array; `1`: DLPack for every tensor; `0`: numpy arrays (host memory) for every tensor "
                    "(docs/tensorflow.md); must be the same on every rank")
STALL_CHECK_DISABLE = _bool(names.HOROVOD_STALL_CHECK_DISABLE, False, EVERY_RANK,
                            "`1`: no stall warning, no shutdown and (unless `PHALANX_STALL_CHECK_S` is set) no "
                            "stall inspector (`phalanxrun --no-stall-check`)")
STALL_CHECK_TIME = _maybe_seconds(
    names.HOROVOD_STALL_CHECK_TIME_SECONDS, "`60`", EVERY_RANK,
    "a collective that waits this long logs Horovod's stall warning (once per wait, on the waiting rank, "
    "naming the collective and its ranks); when set, it is also the stall inspector's time in place of "
    "`PHALANX_STALL_CHECK_S`'s default (`--stall-check-warning-time-seconds`)", positive=False)
STALL_SHUTDOWN_TIME = _seconds(
    names.HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, 0.0, EVERY_RANK,
    "a rank whose collective has waited this long gives up with `HorovodInternalError` naming it; as in "
    "Horovod, a value below the warning time is ignored with a warning (`--stall-check-shutdown-time-seconds`)",
    "`0` (never)", positive=False)
GLOO_TIMEOUT = _maybe_seconds(
    names.HOROVOD_GLOO_TIMEOUT_SECONDS, "torch's (30 min; Horovod: 30 s)", "`hvd.init()`",
    "the timeout for one gloo operation of every process group phalanx creates (the default one, the "
    "process sets', the transport's) and of its shared-memory waits; across hosts, three quarters of it "
    "(at most 30 s) is how long a host may send no heartbeat (`--gloo-timeout-seconds`)", positive=True)
LOG_LEVEL = Setting(names.HOROVOD_LOG_LEVEL, "", level, "`TRACE`...`FATAL`",
                    "unset: logging as the application set it", "`hvd.init()`",
                    "the `phalanx` loggers' level, printed to stderr in Horovod's layout `[time: L logger] "
                    "message` (`--log-level`; `TRACE` logs as DEBUG)")
NCCL_IB_DISABLE = _text(names.NCCL_IB_DISABLE, "bool", "unset", "NCCL (CUDA ranks)",
                        "`1`: NCCL stays off InfiniBand; `phalanxrun --tcp` sets it, as horovodrun does")
LOG_HIDE_TIME = _bool(names.HOROVOD_LOG_HIDE_TIME, False, "`hvd.init()`",
                      "`1`: no time in those lines (`--log-without-timestamp`)")
STALL_CHECK = _maybe_seconds(
    names.PHALANX_STALL_CHECK_S, "`5`", EVERY_RANK,
    "a collective that waits this long makes the rank publish what it waits on in the job's store and look "
    "for ranks blocked on collectives of different process sets, which then raise `CollectiveMismatchError` "
    "on every such rank (a merely slow rank keeps them waiting, up to the transport's timeout); `0` turns "
    "the stall inspector off (see [torch.md](torch.md#errors-instead-of-hangs))", positive=False)
MALLOC_TUNE = _bool(names.PHALANX_MALLOC_TUNE, True, EVERY_RANK,
                    "`0`: keep glibc's malloc defaults. By default `hvd.init()` raises glibc's mmap threshold to "
                    "256 MiB and its trim threshold to 512 MiB, so that freed large tensors (new-tensor "
                    "`hvd.allreduce` results, activations) are reused from the heap instead of being "
                    "page-faulted in from a fresh `mmap` every time; the cost is that a rank keeps up to 512 MiB "
                    "of freed memory instead of returning it to the kernel (see "
                    "[torch.md](torch.md#memory-allocation))")
ELASTIC_TIMEOUT = _seconds(names.PHALANX_ELASTIC_TIMEOUT_S, DEFAULT_ELASTIC_TIMEOUT_S, "elastic jobs",
                           "how long a worker waits for the next round and for one collective "
                           "(`--elastic-timeout`); see [elastic.md](elastic.md)")
ELASTIC_CHECKPOINT_DIR = _text(names.PHALANX_ELASTIC_CHECKPOINT_DIR, "path or URL", "unset", "elastic jobs",
                               "`commit()` also writes the state there (a directory: temporary file, flushed, then "
                               "rename; an fsspec URL such as `s3://bucket/dir`: one whole object), so a new rank 0 "
                               "can load it")
TEARDOWN_GRACE = _seconds(names.PHALANX_TEARDOWN_GRACE_S, DEFAULT_TEARDOWN_GRACE_S,
                          "local, hosts and Spark launchers",
                          "grace between SIGTERM and SIGKILL when a job is torn down (after a failure, a start "
                          "timeout or Ctrl-C)", positive=False)
DASHBOARD = _text(names.PHALANX_DASHBOARD, "port", "unset (off)", "driver (every launcher)",
                  "the job's live page and `/metrics`: `1` (a free port on 127.0.0.1), `PORT`, or `HOST:PORT`; "
                  "`0`: off (`phalanx.run(dashboard=)` and `phalanxrun --dashboard` override it); see "
                  "[observe.md](observe.md)")
MLFLOW = _bool(names.PHALANX_MLFLOW, False, "driver (every launcher)",
               "`1`: log the job's metrics (rank 0's) and timeline summary to the driver's active MLflow run "
               "(`phalanx.run(mlflow=True)`, `phalanxrun --mlflow`); see [observe.md](observe.md)")
CONNECT_CLIENT_HOST = _text(names.PHALANX_CONNECT_CLIENT_HOST, "address",
                            "the local address of the route to the Connect server",
                            "`phalanx.spark` on a Spark Connect client",
                            "where rank 0's task tries to reach the client (for 3 s) to stream logs live; "
                            "unreachable: logs return with the result (docs/spark.md, \"Spark Connect\")")

#: The worker contract's phalanx variables, in docs/env.md's order.
CONTRACT: tuple[Setting[Any], ...] = (HOSTNAME, RUN_ID, CHANNEL, SECRET, START_TIMEOUT, PARENT_PID)
#: Variables particular launchers or jobs set.
LAUNCHER_SET: tuple[Setting[Any], ...] = (LOG_TO_DRIVER, ELASTIC_WORKER_ID, STATS_INTERVAL)
#: Knobs a user may set, in docs/env.md's order.
KNOBS: tuple[Setting[Any], ...] = (
    HOROVOD_START_TIMEOUT, HOROVOD_SPARK_START_TIMEOUT, FUSION_THRESHOLD, CYCLE_TIME, TIMELINE,
    TIMELINE_MARK_CYCLES, TIMELINE_ALL_RANKS,
    TIMELINE_MAX_MB, DYNAMIC_PROCESS_SETS, WARM_START, SHM, SHM_TIMEOUT, SHM_SLOT_BYTES, SHM_NATIVE, SHM_CMA,
    SHM_THP, SHM_GRAD_ASYNC, SHM_EARLY_REDUCE, TF_DLPACK, STALL_CHECK_DISABLE, STALL_CHECK_TIME, STALL_SHUTDOWN_TIME,
    GLOO_TIMEOUT, LOG_LEVEL, NCCL_IB_DISABLE, LOG_HIDE_TIME, STALL_CHECK, MALLOC_TUNE, ELASTIC_TIMEOUT,
    ELASTIC_CHECKPOINT_DIR, TEARDOWN_GRACE, CONNECT_CLIENT_HOST, DASHBOARD, MLFLOW,
)
