"""docs/env.md's tables, in order: phalanx's own settings (``phalanx.env.settings``) and the other tools'
variables phalanx writes or reads (torch's, Horovod's rank names, Spark's, Slurm's, MPI's).

``tools/gen_env.py`` renders them; ``tests/examples/test_docs.py`` checks the committed page equals the
rendering and that every name in ``phalanx.env.names`` is in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.env import names, settings


@dataclass(frozen=True)
class Doc:
    """A documented variable that phalanx does not parse as a setting (another tool's, or a group of them).

    Attributes:
        names: the variables of the row.
        shown_default: an example (contract table) or the default (knobs table).
        unit: what the value is.
        read_by: who reads it (knobs) or sets it (launcher table).
        effect: what it means.
    """

    names: tuple[str, ...]
    shown_default: str
    unit: str
    read_by: str
    effect: str

    @property
    def title(self) -> str:
        """The variables as docs/env.md's tables show them."""
        return ", ".join(f"`{n}`" for n in self.names)


def _doc(variables: tuple[str, ...], shown: str, effect: str, unit: str = "", read_by: str = "") -> Doc:
    return Doc(variables, shown, unit, read_by, effect)


_SLURM = (names.SLURM_PROCID, names.SLURM_NTASKS, names.SLURM_LOCALID, names.SLURM_NODEID, names.SLURM_NNODES,
          names.SLURM_NTASKS_PER_NODE, names.SLURM_TASKS_PER_NODE, names.SLURM_JOB_NODELIST, names.SLURM_JOB_ID)
_MPI = (names.OMPI_COMM_WORLD_RANK, names.OMPI_COMM_WORLD_SIZE, names.OMPI_COMM_WORLD_LOCAL_RANK,
        names.OMPI_COMM_WORLD_LOCAL_SIZE, names.PMI_RANK, names.PMI_SIZE, names.MPI_LOCALRANKID,
        names.MPI_LOCALNRANKS)

#: What every rank receives (shown_default: the value in rank 1 of a 2-rank job on one host).
CONTRACT: tuple[Any, ...] = (
    _doc((names.RANK,), "`1`", "global rank, 0 ≤ `RANK` < `WORLD_SIZE` (on Spark: the barrier partition id)"),
    _doc((names.WORLD_SIZE,), "`2`", "number of ranks"),
    _doc((names.LOCAL_RANK,), "`1`", "rank among the ranks on this host (pin a GPU with it: `cuda:LOCAL_RANK`)"),
    _doc((names.LOCAL_WORLD_SIZE,), "`2`", "number of ranks on this host"),
    _doc((names.GROUP_RANK,), "`0`", "index of this host among the job's hosts (torchrun's \"node rank\")"),
    _doc((names.GROUP_WORLD_SIZE,), "`1`", "number of hosts"),
    _doc((names.ROLE_RANK, names.ROLE_WORLD_SIZE), "`1`, `2`",
         "as `RANK` / `WORLD_SIZE` (torchrun sets them; some libraries read them)"),
    _doc((names.MASTER_ADDR, names.MASTER_PORT), "`127.0.0.1`, `32827`",
         "the job's rendezvous store the launcher hosts (locally: the driver; on Spark: the driver, at "
         "`spark.driver.host`); its socket is bound before any rank starts; only clients that hold "
         "`PHALANX_SECRET` are served (`init_process_group`'s `env://` connects such a client), so a `TCPStore` "
         "client is refused"),
    _doc((names.TORCHELASTIC_USE_AGENT_STORE,), "`True`",
         "`env://` rendezvous connects every rank to that store as a client, instead of rank 0 starting one (as "
         "under torchrun, whose agent hosts it)"),
    _doc((names.TORCHELASTIC_RUN_ID,), "`phalanx-f259f872600e`",
         "the job's id; Lightning detects a torchrun-style job by it and joins it instead of spawning processes"),
    _doc((names.TORCHELASTIC_RESTART_COUNT,), "`0`", "re-formations so far (elastic jobs count up; otherwise 0)"),
    _doc((names.TORCHELASTIC_MAX_RESTARTS,), "`0`", "as torchrun sets it"),
    _doc((names.HOROVOD_RANK, names.HOROVOD_SIZE), "`1`, `2`", "Horovod's names for `RANK` / `WORLD_SIZE`"),
    _doc((names.HOROVOD_LOCAL_RANK, names.HOROVOD_LOCAL_SIZE), "`1`, `2`",
         "Horovod's names for `LOCAL_RANK` / `LOCAL_WORLD_SIZE`"),
    _doc((names.HOROVOD_CROSS_RANK, names.HOROVOD_CROSS_SIZE), "`0`, `1`",
         "among the ranks with the same local rank on every host: this rank's index and their number (Horovod's "
         "definition)"),
    *settings.CONTRACT,
    _doc((names.PYTHONUNBUFFERED,), "`1`", "output streams line by line (a value the user set is kept)"),
    _doc((names.OMP_NUM_THREADS,), "`1`",
         "`cores // LOCAL_WORLD_SIZE` (at least 1) when the user has not set it, so N ranks do not each spin an "
         "N-core OpenMP pool (torchrun does the same)"),
    _doc((names.TORCH_FR_BUFFER_SIZE,), "`2000`",
         "torch's Flight Recorder keeps each rank's last 2000 NCCL / gloo collectives, which the hang report shows "
         "(docs/torch.md); unless the user set it or its older name `TORCH_NCCL_TRACE_BUFFER_SIZE` (`0` turns it "
         "off)"),
    _doc((names.TORCH_FR_DUMP_TEMP_FILE, names.TORCH_NCCL_DEBUG_INFO_TEMP_FILE),
         "`/tmp/phalanx-fr-k2x9/nccl_trace_rank_`",
         "where torch's NCCL watchdog writes the rank's Flight Recorder dump on a timeout: a directory of the rank's "
         "own (0700, random name) made by the process that started it, which sends the dump's summary as the "
         "rank's last lines when it fails and keeps the file for torch's `fr_trace` (docs/torch.md); unless the "
         "user set either"),
)

#: Set by particular launchers or jobs (read_by: who sets it).
LAUNCHER_SET: tuple[Any, ...] = (
    *settings.LAUNCHER_SET,
    _doc((names.CUDA_VISIBLE_DEVICES,), "", "the GPUs Spark gave the ranks of this host "
         "(`TaskContext.resources()[\"gpu\"]`, one per rank when a task of `k` GPUs runs `k` ranks; read through "
         "the executor's own `CUDA_VISIBLE_DEVICES` when a cluster manager set it), in local-rank order, so "
         "`cuda:LOCAL_RANK` is the rank's own; in local mode, the driver's GPUs",
         read_by="`TorchDistributor(use_gpu=True)`, `HorovodRunner` / `run` when tasks hold GPUs"),
    _doc((names.NCCL_SOCKET_IFNAME, names.GLOO_SOCKET_IFNAME), "",
         "the NICs NCCL's and gloo's own sockets use, unless the user set them for the ranks",
         read_by="`phalanxrun --network-interfaces`, `phalanx.run(network_interfaces=)`, `phalanx.spark.run(nics=)`"),
    _doc((names.HOROVOD_TIMELINE, names.HOROVOD_TIMELINE_MARK_CYCLES), "", "see the knobs below",
         read_by="`phalanxrun --timeline-filename F [--timeline-mark-cycles]`"),
)

#: Knobs a user may set, and other tools' variables phalanx reads.
KNOBS: tuple[Any, ...] = (
    *settings.KNOBS,
    _doc((names.OMP_NUM_THREADS,), "`cores // LOCAL_WORLD_SIZE`",
         "set it yourself to choose torch's intra-op threads per rank", "threads", "ranks"),
    _doc((names.PYSPARK_PYTHON,), "the driver's `sys.executable`",
         "the interpreter executors run for phalanx's barrier stage (set on phalanx's RDD only)", "path",
         "`phalanx.spark`"),
    _doc((names.SPARK_LOCAL_HOSTNAME, names.SPARK_LOCAL_IP), "unset",
         "an executor's host identity; ranks with the same one are local ranks of one host", "name / address",
         "`phalanx.spark` tasks"),
    _doc((names.PYTHONPATH,), "the driver's",
         "forwarded to every rank on every host, with every `HOROVOD_*`, `NCCL_*` and `PHALANX_*` variable and "
         "the `-x/--env` ones (docs/hosts.md)", "path list", "`phalanxrun -H` / `phalanx.run(hosts=)`"),
    _doc(_SLURM, "set by `srun`",
         "when no phalanx or torchrun contract (`RANK`) is present, `hvd.init()` reads them as `RANK`, "
         "`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`; `MASTER_ADDR` "
         "defaults to the first node of the node list and `MASTER_PORT` to 15000 + job id mod 20000 "
         "(docs/hosts.md)", "ints / node list", "`hvd.init()` (`phalanx.env.foreign`)"),
    _doc(_MPI, "set by Open MPI's / MPICH's `mpirun`",
         "read as torch's names as above; `MASTER_ADDR` must be given (`mpirun -x MASTER_ADDR=node1`), else "
         "`hvd.init()` raises `WorkerContractError` saying so; `MASTER_PORT` defaults to 29500", "ints",
         "`hvd.init()` (`phalanx.env.foreign`)"),
    _doc((names.CUDA_VISIBLE_DEVICES,), "—",
         "set by phalanx on Spark with `use_gpu=True` (see above); otherwise yours", "GPU list", "torch"),
    _doc((names.MLFLOW_RUN_ID,), "unset",
         "with `PHALANX_MLFLOW=1` / `--mlflow`: the run to log to when none is active in the driver's thread "
         "(`phalanxrun --mlflow`)", "id", "driver (MLflow's own variable)"),
)
