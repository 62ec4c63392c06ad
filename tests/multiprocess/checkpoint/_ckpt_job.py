"""Jobs for the checkpoint tests: an FSDP2 model trained on per-step data, and a ZeRO-style flat partition."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

PARAM_ROWS = 10  # a flat partition that 2 and 3 ranks split unevenly


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))


def _sums(model: Any) -> dict[str, float]:
    return {k: round(float(v.full_tensor().double().sum()), 6) for k, v in model.state_dict().items()}


def train(url: str, steps: int, record: str, stop_at: int | None = None, resume: bool = True) -> dict[str, Any]:
    """FSDP2 on every rank; an async sharded save every 2 steps (keep 2); rank 0 records the weights after each
    step. At ``stop_at`` rank 0 waits for its pending save, writes ``<record>.reached`` and sleeps (the test
    then kills the whole job)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import phalanx.torch as hvd
    from phalanx.torch.checkpoint import Checkpointer, TrainState

    hvd.init()
    model = _model()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    app = TrainState(model, opt, step=0)
    ckpt = Checkpointer(url, keep_last=2, resume=resume)
    start = ckpt.restore({"app": app})
    restored = _sums(model)
    for step in range(start + 1, steps + 1):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4 * hvd.size(), 16, generator=gen)[hvd.rank()::hvd.size()]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        app.extra["step"] = step
        sums = _sums(model)  # full_tensor() is a collective: every rank
        if hvd.rank() == 0:
            with open(record, "a") as f:
                f.write(json.dumps({"step": step, "sums": sums}) + "\n")
        if step % 2 == 0:
            ckpt.save(step, {"app": app}, async_save=True)
        if step == stop_at and hvd.rank() == 0:
            ckpt.wait()
            Path(f"{record}.part").write_text(str(os.getpid()))
            os.replace(f"{record}.part", f"{record}.reached")  # whole when the test sees it
            time.sleep(120)  # under test: the ranks still run when their driver is killed
        elif step == stop_at:
            time.sleep(120)  # under test: as rank 0
    ckpt.close()
    return {"start": start, "restored": restored, "steps": ckpt.steps(), "size": hvd.size()}


def partitioned(url: str, save: bool) -> list[float]:
    """A ZeRO-style flat parameter and its Adam moment, each rank holding a contiguous slice (a DTensor sharded
    on dim 0); saved at one world size, loaded at another: each rank's slice holds the rows it should."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import phalanx.torch as hvd
    from phalanx.torch.checkpoint import Checkpointer

    hvd.init()
    mesh = init_device_mesh("cpu", (hvd.size(),))
    full = torch.arange(PARAM_ROWS * 3, dtype=torch.float32).view(PARAM_ROWS, 3)
    value = full if save else torch.zeros_like(full)
    state = {"flat": distribute_tensor(value.clone(), mesh, [Shard(0)]),
             "exp_avg": distribute_tensor(value * 2, mesh, [Shard(0)])}
    ckpt = Checkpointer(url, keep_last=None)
    if save:
        ckpt.save(1, state)
        return []
    assert ckpt.load(state) == 1
    local = state["flat"].to_local()
    rows = state["flat"].full_tensor()
    assert torch.equal(rows, full) and torch.equal(state["exp_avg"].full_tensor(), full * 2)
    return local.flatten().tolist()
