"""``make gpu-check``: phalanx's GPU matrix on a CUDA machine, printed as one table.

    python tools/gpu_check.py detect     # exit 0 when this machine has a CUDA GPU (stdlib only: runs before
                                         # the CUDA build of torch is installed); else one line, exit 1
    python tools/gpu_check.py run        # the matrix on every visible GPU (in the CUDA venv make builds)
    python tools/gpu_check.py selftest   # the same checks on CPU with gloo and tiny sizes (make test runs it)

Rows: phalanx.torch collectives on CUDA tensors (every op, fp16/bf16/fp32, the global and a registered process
set; results checked, and checked to stay on the GPU), DistributedOptimizer vs DDP on NCCL (a ResNet-18-layout
CNN on synthetic images: images/s and the ratio), DDP and FSDP under ``phalanxrun``, Keras on GPU (and the
DLPack route's time per fused gradient allreduce against the host route's),
``TorchDistributor(use_gpu=True, local_mode=True)``, the elastic kill test (a rank SIGKILLed mid-training, the
job completes) and the hang report (a rank that skips a collective: the report names it, with stacks and the
Flight Recorder). The exit status is 1 when a row failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SMOKE_ENV = {"PHALANX_STALL_CHECK_S": "0.5", "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
             "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    check: str
    setting: str
    result: str  # "ok", "FAIL: ...", "skipped: ..."
    figure: str = ""


@dataclass(frozen=True)
class Plan:
    """Where and how big: ``cuda`` on every visible GPU, or ``cpu`` (the self-test) on 2 ranks, tiny sizes."""

    device: str
    ranks: int
    dtypes: tuple[str, ...]
    image: int
    batch: int
    steps: int
    width: int


def detect() -> str | None:
    """Why this machine cannot run the matrix (one line), or None when ``nvidia-smi`` lists a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "gpu-check: no CUDA GPU on this machine (nvidia-smi not found); nothing to check"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"gpu-check: no CUDA GPU on this machine (nvidia-smi -L failed: {e}); nothing to check"
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        return (f"gpu-check: no CUDA GPU on this machine (nvidia-smi -L lists none, exit {out.returncode}); "
                "nothing to check")
    return None


# ---- rank functions (run by phalanx in every rank) -------------------------------------------------------

def _device(plan: Plan, local_rank: int | None = None) -> Any:
    """This rank's device: ``cuda:hvd.local_rank()`` (the pinning under test), or ``local_rank`` when given."""
    import torch

    import phalanx.torch as hvd

    if plan.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() if local_rank is None else local_rank)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped_allreduce")


def _op(op: str, ps: Any, dev: Any, dtype: Any) -> tuple[Any, Any]:
    """Run ``op`` on process set ``ps``; return (its result, the result every rank must get)."""
    import torch

    import phalanx.torch as hvd

    size, me = ps.size(), ps.rank()
    base = torch.arange(8, device=dev).to(dtype)
    if op == "allreduce":
        return hvd.allreduce(base + me, op=hvd.Sum, process_set=ps), (base * size + size * (size - 1) // 2).to(dtype)
    if op == "allgather":
        rows = torch.stack([base + r for r in range(size)])
        return hvd.allgather(base[None] + me, process_set=ps), rows
    if op == "broadcast":
        return hvd.broadcast(base + me, root_rank=ps.ranks[0], process_set=ps), base
    if op == "alltoall":
        mine = torch.full((size,), float(me), device=dev).to(dtype)
        return hvd.alltoall(mine, process_set=ps), torch.arange(size, device=dev).to(dtype)
    if op == "reducescatter":
        ones = torch.ones(size * 2, device=dev).to(dtype)
        return hvd.reducescatter(ones, op=hvd.Sum, process_set=ps), torch.full((2,), float(size), device=dev).to(dtype)
    reduced = hvd.grouped_allreduce([base, base + 1], op=hvd.Sum, process_set=ps)
    return reduced[1], ((base + 1) * size).to(dtype)


def collectives_rank(plan: Plan) -> list[tuple[str, str, str, str]]:
    """Every op x dtype x process set on this rank's device; (op, dtype, set, "ok" or what went wrong)."""
    import torch

    import phalanx.torch as hvd

    n = plan.ranks
    subset = hvd.ProcessSet(list(range(0, n, 2)) if n > 2 else list(range(n)))
    hvd.init(process_sets=[subset])
    dev = _device(plan)
    out = []
    for ps_name, ps in (("global", hvd.global_process_set), ("subset", subset)):
        if not ps.included():
            continue
        for dt in plan.dtypes:
            for op in OPS:
                try:
                    result, expected = _op(op, ps, dev, getattr(torch, dt))
                    if result.device != dev:
                        out.append((op, dt, ps_name, f"result on {result.device}, not {dev} (a host copy)"))
                    else:
                        out.append((op, dt, ps_name, "ok" if torch.equal(result, expected) else "wrong values"))
                except Exception as e:  # a row, not the end of the check
                    out.append((op, dt, ps_name, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    hvd.shutdown()
    return out


def _resnet(width: int, classes: int = 100) -> Any:
    """A ResNet-18-layout CNN (BasicBlocks 2-2-2-2) of base width ``width`` (64: ResNet-18's 11.7 M params)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                      nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                      nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            return (self.body(x) + self.skip(x)).relu()

    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8)):
        cout = width * mult
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def train_rank(plan: Plan, mode: str) -> float:
    """Train the CNN on synthetic images with ``mode`` (``"hvd"``: DistributedOptimizer; ``"ddp"``: DDP on NCCL,
    gloo on CPU); return this rank's images/s over the timed steps."""
    import torch
    import torch.distributed as dist

    import phalanx.torch as hvd

    if mode == "hvd":
        hvd.init()
        dev = _device(plan)
    else:  # plain torch: no phalanx.torch in this rank (its control blocks need a CPU backend)
        dist.init_process_group("nccl" if plan.device == "cuda" else "gloo")
        dev = _device(plan, int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = _resnet(plan.width).to(dev)
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "hvd":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    x = torch.randn(plan.batch, 3, plan.image, plan.image, device=dev)
    y = torch.randint(0, 100, (plan.batch,), device=dev)
    warmup = max(1, plan.steps // 4)
    for step in range(warmup + plan.steps):
        if step == warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rate = plan.batch * plan.steps / (time.perf_counter() - start)
    if mode == "hvd":
        hvd.shutdown()
    else:
        dist.destroy_process_group()
    return rate


def distributor_rank(plan: Plan) -> tuple[str, int, int]:
    """What ``TorchDistributor(use_gpu=...)`` gave this rank: its CUDA_VISIBLE_DEVICES, local rank and device."""
    import torch

    import phalanx.torch as hvd

    hvd.init()
    device = _device(plan)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    value = int(hvd.allreduce(torch.ones(1, device=device), op=hvd.Sum).item())
    hvd.shutdown()
    return visible, value, -1 if device.type == "cpu" else int(device.index)


def elastic_rank(plan: Plan, marker: str) -> int:
    """Train with ``hvd.elastic.run``; rank 1 SIGKILLs itself once at step 5; return the final world's size."""
    import signal

    import torch

    import phalanx.torch as hvd

    hvd.init()
    dev = _device(plan)
    model = torch.nn.Linear(32, 4).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def loop(state: Any) -> int:
        while state.step < 12:
            if state.step == 5 and hvd.rank() == 1 and not Path(marker).exists():
                Path(marker).write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            model(torch.randn(8, 32, device=dev)).sum().backward()
            opt.step()
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
        return int(hvd.size())

    return int(loop(state))


def hang_rank(plan: Plan) -> None:
    """Rank 1 skips the collective ``val_loss`` its peers issue (it is busy elsewhere)."""
    import torch

    import phalanx.torch as hvd

    hvd.init()
    dev = _device(plan)
    hvd.allreduce(torch.ones(4096, device=dev), name="warmup")  # above the inline size: NCCL carries it on GPU
    if hvd.rank() == 1:
        time.sleep(60)
    hvd.allreduce(torch.ones(4096, device=dev), name="val_loss")


_DDP_FSDP_SCRIPT = """
import os, sys, torch, torch.distributed as dist
cuda = sys.argv[1] == "cuda"
dist.init_process_group("nccl" if cuda else "gloo")
local = int(os.environ["LOCAL_RANK"])
dev = torch.device("cuda", local) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(dev)
if sys.argv[2] == "fsdp":
    from torch.distributed.fsdp import FullyShardedDataParallel
    model = FullyShardedDataParallel(model, device_id=dev if cuda else None)
else:
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(16, 64, device=dev)).sum().backward()
    opt.step()
total = torch.ones(1, device=dev)
dist.all_reduce(total)
assert int(total.item()) == dist.get_world_size()
dist.destroy_process_group()
"""


# ---- the checks (on the driver) -----------------------------------------------------------------------------

def check_collectives(plan: Plan) -> list[Row]:
    import phalanx

    rows = [r for rank in phalanx.run(collectives_rank, args=(plan,), np=plan.ranks) for r in rank]
    bad = sorted({f"{op}/{dt}/{ps}: {why}" for op, dt, ps, why in rows if why != "ok"})
    ops = sorted({op for op, *_ in rows})
    setting = f"{len(ops)} ops x {','.join(plan.dtypes)} x global+subset, {plan.ranks} ranks"
    return [Row("collectives", setting, "ok" if not bad else "FAIL: " + "; ".join(bad[:4]), f"{len(rows)} calls")]


def check_training(plan: Plan) -> list[Row]:
    import phalanx

    rates = {mode: sum(phalanx.run(train_rank, args=(plan, mode), np=plan.ranks)) for mode in ("hvd", "ddp")}
    backend = "NCCL" if plan.device == "cuda" else "gloo"
    setting = f"ResNet-18 layout, width {plan.width}, {plan.image}px, batch {plan.batch}/rank"
    return [Row("DistributedOptimizer", setting, "ok", f"{rates['hvd']:.1f} img/s"),
            Row(f"DDP on {backend}", setting, "ok", f"{rates['ddp']:.1f} img/s"),
            Row("DistributedOptimizer / DDP", "", "ok", f"{rates['hvd'] / rates['ddp']:.2f}x")]


def check_phalanxrun(plan: Plan) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-check-") as tmp:
        script = Path(tmp, "ddp_fsdp.py")
        script.write_text(textwrap.dedent(_DDP_FSDP_SCRIPT))
        for kind in ("ddp", "fsdp"):
            if kind == "fsdp" and plan.device == "cpu":
                rows.append(Row("phalanxrun FSDP", "", "skipped: CPU self-test (FSDP needs a GPU)"))
                continue
            out = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "-np", str(plan.ranks), sys.executable,
                                  str(script), plan.device, kind], capture_output=True, text=True, timeout=600,
                                 check=False)
            tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1][:160]
            rows.append(Row(f"phalanxrun {kind.upper()}", f"{plan.ranks} ranks",
                            "ok" if out.returncode == 0 else f"FAIL: exit {out.returncode}: {tail}"))
    return rows


def check_keras(plan: Plan) -> list[Row]:
    if plan.device == "cpu":
        return [Row("Keras", "", "skipped: CPU self-test (tests/multiprocess/tensorflow covers Keras on CPU)")]
    try:
        import tensorflow as tf
    except ImportError:
        return [Row("Keras", "", "skipped: TensorFlow is not installed in the GPU venv")]
    if not tf.config.list_physical_devices("GPU"):
        return [Row("Keras", "", "skipped: TensorFlow sees no GPU (a CUDA build of TensorFlow is needed)")]
    import phalanx

    losses = phalanx.run(keras_rank, np=plan.ranks)
    same = max(losses) - min(losses) < 1e-4
    rows = [Row("Keras", f"{plan.ranks} ranks, DistributedOptimizer", "ok" if same else f"FAIL: losses {losses}")]
    route = phalanx.run(tf_route_rank, np=plan.ranks)[0]
    ok = "ok" if route["cuda"] and route["agree"] else f"FAIL: {route}"
    return [*rows, Row("TF DLPack route", "fused allreduce, 25.6M fp32 in 50 tensors", ok,
                       f"{route['dlpack_ms']:.1f} ms vs host route {route['host_ms']:.1f} ms "
                       f"({route['dlpack_ms'] / route['host_ms']:.2f}x)")]


def _own_tf_gpu() -> None:
    """Give TensorFlow this rank's GPU only (before it initializes them)."""
    import tensorflow as tf

    own = tf.config.list_physical_devices("GPU")[int(os.environ["LOCAL_RANK"])]
    tf.config.set_visible_devices(own, "GPU")
    tf.config.experimental.set_memory_growth(own, True)


def tf_route_rank() -> dict[str, Any]:
    """ms per fused gradient allreduce of ResNet-50's size on this rank's GPU, by the DLPack route (the default
    for GPU tensors) and the host route (``PHALANX_TF_DLPACK=0``), interleaved; whether the DLPack route handed
    torch CUDA tensors, and whether both routes agree."""
    import statistics

    import tensorflow as tf

    import phalanx.tensorflow as hvd
    from phalanx.tensorflow import _dlpack, ops

    _own_tf_gpu()
    hvd.init()
    devices: set[str] = set()
    to_torch = _dlpack.to_torch

    def seen(tensor: Any) -> Any:
        out = to_torch(tensor)
        devices.add(out.device.type)
        return out

    _dlpack.to_torch = seen
    tensors = [tf.random.normal([512_000], seed=hvd.rank()) for _ in range(50)]
    times: dict[str, list[float]] = {"auto": [], "0": []}
    results = {}
    for route in ("auto", "0") * 4:
        os.environ["PHALANX_TF_DLPACK"] = route
        hvd.allreduce(tf.zeros([1]), name="gpu_check.sync")
        start = time.perf_counter()
        for _ in range(5):
            last = ops.fused_allreduce(tensors, hvd.Average, hvd.Compression.none, "gpu_check.route")[-1]
        assert last is not None
        results[route] = last.numpy()
        times[route].append((time.perf_counter() - start) / 5 * 1e3)
    os.environ.pop("PHALANX_TF_DLPACK")
    return {"dlpack_ms": statistics.median(times["auto"][1:]), "host_ms": statistics.median(times["0"][1:]),
            "cuda": devices == {"cuda"}, "agree": bool(abs(results["auto"] - results["0"]).max() < 1e-5)}


def keras_rank() -> float:
    """A Keras model fitted one epoch with phalanx.tensorflow.keras on this rank's GPU; its final loss."""
    import numpy as np
    import tensorflow as tf

    import phalanx.tensorflow.keras as hvd

    _own_tf_gpu()
    hvd.init()
    model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
    rng = np.random.default_rng(hvd.rank())
    history = model.fit(rng.normal(size=(512, 32)), rng.normal(size=(512, 1)), batch_size=32, epochs=1, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return float(hvd.allreduce(history.history["loss"][-1]))


def check_distributor(plan: Plan) -> list[Row]:
    from phalanx.spark import TorchDistributor

    gpu = plan.device == "cuda"
    got = [TorchDistributor(num_processes=plan.ranks, local_mode=True, use_gpu=gpu).run(distributor_rank, plan)]
    visible, total, device = got[0]
    good = total == plan.ranks and (not gpu or device == 0)
    setting = f"use_gpu={gpu}, local_mode=True, {plan.ranks} ranks"
    return [Row("TorchDistributor", setting, "ok" if good else f"FAIL: {got}", f"CUDA_VISIBLE_DEVICES={visible!r}")]


def check_elastic(plan: Plan) -> list[Row]:
    import phalanx

    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-check-") as tmp:
        sizes = phalanx.run(elastic_rank, args=(plan, str(Path(tmp, "killed"))), np=plan.ranks, min_np=1,
                            reset_limit=2, env={"PHALANX_ELASTIC_TIMEOUT_S": "60"})
        killed = Path(tmp, "killed").exists()
    good = killed and len(sizes) == plan.ranks and set(sizes) == {plan.ranks}
    return [Row("elastic kill", "rank 1 SIGKILLed at step 5", "ok" if good else f"FAIL: killed={killed} {sizes}")]


def check_hang_report(plan: Plan) -> list[Row]:
    import phalanx
    from phalanx.errors import WorkerFailedError

    try:
        phalanx.run(hang_rank, args=(plan,), np=plan.ranks, env=SMOKE_ENV)
        return [Row("hang report", "", "FAIL: the job did not fail")]
    except WorkerFailedError as e:
        text = str(e)
    wanted = ["phalanx hang report", "allreduce 'val_loss'", "lacks rank(s) [1]", "in hang_rank",
              "Flight Recorder", "nccl:" if plan.device == "cuda" else "gloo:"]
    missing = [w for w in wanted if w not in text]
    return [Row("hang report", "rank 1 skips 'val_loss'", "ok" if not missing else f"FAIL: missing {missing}")]


CHECKS: tuple[Callable[[Plan], list[Row]], ...] = (
    check_collectives, check_training, check_phalanxrun, check_keras, check_distributor, check_elastic,
    check_hang_report,
)


def matrix(plan: Plan, checks: tuple[Callable[[Plan], list[Row]], ...] = CHECKS) -> list[Row]:
    """Run ``checks``; a check that raises is a failed row, not the end of the matrix."""
    rows: list[Row] = []
    for check in checks:
        name = check.__name__.removeprefix("check_")
        try:
            rows += check(plan)
        except Exception as e:
            rows.append(Row(name, "", f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
    return rows


def table(rows: list[Row]) -> str:
    """The rows as one aligned text table."""
    head = Row("check", "setting", "result", "figure")
    cols = list(zip(*[(r.check, r.setting, r.result, r.figure) for r in [head, *rows]]))
    widths = [max(len(c) for c in col) for col in cols]
    lines = []
    for i, r in enumerate([head, *rows]):
        cells = (r.check, r.setting, r.result, r.figure)
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def gpu_plan() -> Plan:
    import torch

    return Plan("cuda", torch.cuda.device_count(), ("float16", "bfloat16", "float32"), image=128, batch=32, steps=20,
                width=64)


SELFTEST_PLAN = Plan("cpu", 2, ("bfloat16", "float32"), image=32, batch=4, steps=2, width=8)


def main(argv: list[str]) -> int:
    """``detect`` / ``run`` / ``selftest`` (see the module docstring)."""
    what = argv[0] if argv else "run"
    if what == "detect":
        why = detect()
        if why:
            print(why)
        return 1 if why else 0
    if what == "run":
        import torch

        if not torch.cuda.is_available():
            print(f"gpu-check: torch {torch.__version__} sees no CUDA device; nothing to check")
            return 0
        plan = gpu_plan()
    elif what == "selftest":
        plan = SELFTEST_PLAN
    else:
        print(f"gpu-check: unknown command {what!r}; use detect, run or selftest", file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = matrix(plan)
    print(table(rows))
    print(f"gpu-check: {plan.ranks} {plan.device} rank(s), {time.monotonic() - started:.0f} s")
    return 1 if any(r.result.startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
