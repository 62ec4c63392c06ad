"""Every environment variable phalanx reads or writes, named once.

Nothing else in the package spells a variable name: import the constant from here; read a value through
``phalanx.env.settings``. docs/env.md (written by tools/gen_env.py) documents each one.
"""

from __future__ import annotations

# --- torch.distributed / torchrun names: init_process_group("env://"), DDP, FSDP, Lightning read these.
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

# --- Horovod names: horovod.torch reads these under horovodrun.
HOROVOD_RANK = "HOROVOD_RANK"
HOROVOD_SIZE = "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"

# --- Horovod knobs a user may set (read inside workers by phalanx.torch / phalanx.timeline).
HOROVOD_START_TIMEOUT = "HOROVOD_START_TIMEOUT"
HOROVOD_SPARK_START_TIMEOUT = "HOROVOD_SPARK_START_TIMEOUT"
HOROVOD_FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
HOROVOD_CYCLE_TIME = "HOROVOD_CYCLE_TIME"
HOROVOD_TIMELINE = "HOROVOD_TIMELINE"
HOROVOD_TIMELINE_MARK_CYCLES = "HOROVOD_TIMELINE_MARK_CYCLES"
# Horovod's stall check: "1" turns it off; seconds before a stalled collective is reported; seconds
# before the job is shut down for it (0: never). phalanxrun's --stall-check* flags set them.
HOROVOD_STALL_CHECK_DISABLE = "HOROVOD_STALL_CHECK_DISABLE"
HOROVOD_STALL_CHECK_TIME_SECONDS = "HOROVOD_STALL_CHECK_TIME_SECONDS"
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
# Seconds a gloo operation may take (phalanx.torch's process groups; --gloo-timeout-seconds).
HOROVOD_GLOO_TIMEOUT_SECONDS = "HOROVOD_GLOO_TIMEOUT_SECONDS"
# The phalanx loggers' level in a rank (TRACE, DEBUG, INFO, WARNING, ERROR, FATAL) and "1" to drop the
# time from their lines (--log-level, --log-without-timestamp).
HOROVOD_LOG_LEVEL = "HOROVOD_LOG_LEVEL"
HOROVOD_LOG_HIDE_TIME = "HOROVOD_LOG_HIDE_TIME"
# NCCL's own switch: "1" keeps NCCL off InfiniBand (horovodrun --tcp sets it).
NCCL_IB_DISABLE = "NCCL_IB_DISABLE"
# The NICs NCCL's and gloo's sockets use: set for the ranks from --network-interfaces (and its equivalents).
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
# torch's Flight Recorder (recent NCCL/gloo collectives of each rank): phalanx's ranks get a buffer by default,
# which the hang report reads (phalanx.torch._health.hang).
TORCH_NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
TORCH_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
TORCH_FR_DUMP_TEMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
TORCH_NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
# phalanx timeline knobs: "1" makes every rank write its own trace (path with a ".rankN" suffix) so a
# straggler shows; the cap (MB, both rotation segments together) bounds the trace for long runs.
PHALANX_TIMELINE_ALL_RANKS = "PHALANX_TIMELINE_ALL_RANKS"
PHALANX_TIMELINE_MAX_MB = "PHALANX_TIMELINE_MAX_MB"
HOROVOD_DYNAMIC_PROCESS_SETS = "HOROVOD_DYNAMIC_PROCESS_SETS"

# --- phalanx's own worker contract.
PHALANX_RUN_ID = "PHALANX_RUN_ID"
PHALANX_CHANNEL = "PHALANX_CHANNEL"
PHALANX_SECRET = "PHALANX_SECRET"
PHALANX_START_TIMEOUT_S = "PHALANX_START_TIMEOUT_S"
PHALANX_PARENT_PID = "PHALANX_PARENT_PID"

# --- elastic jobs (phalanx.run(min_np=...)): the worker's stable id (its channel rank; its torch rank
# changes from round to round), the seconds a worker waits for the next round / a collective, and the
# directory where commit() also writes the state (temporary file, then rename).
PHALANX_ELASTIC_WORKER_ID = "PHALANX_ELASTIC_WORKER_ID"
PHALANX_ELASTIC_TIMEOUT_S = "PHALANX_ELASTIC_TIMEOUT_S"
PHALANX_ELASTIC_CHECKPOINT_DIR = "PHALANX_ELASTIC_CHECKPOINT_DIR"

#: Seconds between two stats records a rank sends the driver (steps, collective waits: the live page, metrics
#: and MLflow); set by a launcher only when one of those is on, unset otherwise (no records, no cost).
PHALANX_STATS_INTERVAL_S = "PHALANX_STATS_INTERVAL_S"

# --- phalanx.spark: "1" when log_to_driver() should send its message on the channel (Spark jobs).
PHALANX_LOG_TO_DRIVER = "PHALANX_LOG_TO_DRIVER"

# --- same-host shared-memory transport (phalanx.transport): "0" turns it off (gloo carries everything);
# the seconds a rank waits for its peers inside one shared-memory step before it raises; the bytes of each
# rank's staging slot (larger tensors go through in chunks of this size).
PHALANX_SHM = "PHALANX_SHM"
PHALANX_SHM_TIMEOUT_S = "PHALANX_SHM_TIMEOUT_S"
PHALANX_SHM_SLOT_BYTES = "PHALANX_SHM_SLOT_BYTES"
PHALANX_SHM_CMA = "PHALANX_SHM_CMA"
PHALANX_SHM_GRAD_ASYNC = "PHALANX_SHM_GRAD_ASYNC"
#: "0": no transparent-huge-page advice for the memory peers read by cross-memory attach
#: (phalanx/transport/_huge_pages.py).
PHALANX_SHM_THP = "PHALANX_SHM_THP"
#: "0" turns off the early gradient reduction of a 2-rank one-host DistributedOptimizer (the rank that finished
#: backward first reduces the gradients final on both ranks while it waits; see phalanx/transport/_early.py).
PHALANX_SHM_EARLY_REDUCE = "PHALANX_SHM_EARLY_REDUCE"
#: "0" keeps gloo for torch-native code in a one-host job (``init_process_group("gloo")`` in a rank started by
#: the worker entry), which otherwise gets the phalanx_shm backend (on by default; see docs/shm.md).
PHALANX_SHM_NATIVE = "PHALANX_SHM_NATIVE"
#: "0" leaves glibc's malloc thresholds alone (hvd.init() raises them: large tensors reuse heap memory
#: instead of fresh page-faulted mmaps; see phalanx/torch/_setup/malloc.py for the memory trade-off).
PHALANX_MALLOC_TUNE = "PHALANX_MALLOC_TUNE"
#: seconds a collective may wait before the stall inspector (phalanx/torch/_health/stall.py) publishes what this
#: rank waits on and looks for ranks deadlocked on different process sets; "0" turns it off.
PHALANX_STALL_CHECK_S = "PHALANX_STALL_CHECK_S"

# --- phalanx knobs a user may set on the driver.
PHALANX_TEARDOWN_GRACE_S = "PHALANX_TEARDOWN_GRACE_S"
#: "0" turns warm starts (ranks forked from a pre-imported template) off.
PHALANX_WARM_START = "PHALANX_WARM_START"

#: The job's live page on the driver: "1" (a free port on 127.0.0.1), a port, or host:port; "0"/unset: off.
PHALANX_DASHBOARD = "PHALANX_DASHBOARD"
#: "1": log the job's metrics and timeline summary to the driver's active MLflow run.
PHALANX_MLFLOW = "PHALANX_MLFLOW"
PHALANX_TF_DLPACK = "PHALANX_TF_DLPACK"
#: MLflow's own: the run to log to where none was started in the driver's thread (``phalanxrun --mlflow``).
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"

#: Spark Connect: the address the executors reach this client at (for live logs); default: the local address
#: of the route to the Connect server.
PHALANX_CONNECT_CLIENT_HOST = "PHALANX_CONNECT_CLIENT_HOST"

# --- Spark: the interpreter executors run, and the GPUs a rank may use (from the task's resources).
PYSPARK_PYTHON = "PYSPARK_PYTHON"
# The name / address Spark gives an executor's host; phalanx groups ranks into local ranks by it.
SPARK_LOCAL_HOSTNAME = "SPARK_LOCAL_HOSTNAME"
SPARK_LOCAL_IP = "SPARK_LOCAL_IP"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# --- OpenMP: torch's intra-op threads; phalanx.torch.init() sizes them when the user did not.
OMP_NUM_THREADS = "OMP_NUM_THREADS"

# --- Python runtime: workers stream their output line by line, so it must not be block-buffered.
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
#: Forwarded by the hosts launcher to every rank on every host (as horovodrun forwards it).
PYTHONPATH = "PYTHONPATH"


# --- Other launchers' rank variables, read by hvd.init() when no phalanx launcher started the process
# (phalanx.env.foreign): Slurm's srun, Open MPI's and MPICH's mpirun.
SLURM_PROCID = "SLURM_PROCID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_NNODES = "SLURM_NNODES"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
OMPI_COMM_WORLD_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_COMM_WORLD_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_COMM_WORLD_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
MPI_LOCALRANKID = "MPI_LOCALRANKID"
MPI_LOCALNRANKS = "MPI_LOCALNRANKS"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"
