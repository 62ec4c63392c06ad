"""A DeepSpeed training job as users write it, for every launcher's test: ``deepspeed.init_distributed`` then
``deepspeed.initialize`` with ZeRO stages 1, 2 and 3 in turn on CPU (gloo, ``torch_adam``), no phalanx import.

Run as a script (``python _zero_job.py [--deepspeed --deepspeed_config PATH]``, the arguments pyspark's
DeepspeedTorchDistributor appends) it prints one ``ZERO {json}`` line per rank; :func:`train` returns the same
record. Every stage trains the same model from the same seed on the same per-rank batches, so the stages'
final weights agree (ZeRO partitions state, it does not change the arithmetic) and every rank holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

STAGES = (1, 2, 3)
STEPS = 4
#: The variables DeepSpeed reads to place a rank (deepspeed/comm/comm.py, accelerator/cpu_accelerator.py).
PLACEMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
    }


def _stage(stage: int, base: dict[str, Any] | None) -> dict[str, Any]:
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    initial = _head(list(model.parameters()))
    world = int(os.environ["WORLD_SIZE"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config={**(base or {}), **config(stage, world)})
    data = torch.Generator().manual_seed(100 + engine.global_rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=data)
        loss = (engine(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        weights = _head(params)
    engine.destroy()
    return {"losses": losses, "weights": weights, "initial": initial}


def _head(params: list[Any]) -> list[float]:
    """The first values of each parameter, rounded: enough to tell runs apart."""
    return [round(float(v), 5) for p in params for v in p.detach().reshape(-1)[:4]]


def train(ds_config: str | None = None) -> dict[str, Any]:
    """ZeRO 1-3 in turn in this rank; ``ds_config`` (a JSON file, as ``--deepspeed_config``) is laid under
    each stage's settings."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    base = None
    if ds_config:
        with open(ds_config, encoding="utf-8") as f:
            base = json.load(f)
    stages = {str(s): _stage(s, base) for s in STAGES}
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "stages": stages,
            "base": base, "env": {k: os.environ.get(k) for k in PLACEMENT}}


def check(records: list[dict[str, Any]], world: int, ranks: list[int] | None = None) -> None:
    """The ``ranks`` (default all) ran every stage; the stages' weights agree on every rank; training moved
    the weights."""
    assert sorted(r["rank"] for r in records) == (list(range(world)) if ranks is None else ranks), records
    first = records[0]["stages"]["1"]["weights"]
    for r in records:
        assert r["world"] == world
        for stage in map(str, STAGES):
            got = r["stages"][stage]["weights"]
            assert max(abs(a - b) for a, b in zip(got, first)) < 1e-3, (r["rank"], stage, got, first)
    initial = records[0]["stages"]["1"]["initial"]
    assert max(abs(a - b) for a, b in zip(first, initial)) > 1e-2, (first, initial)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed_config")
    parser.add_argument("--local_rank", type=int)  # deepspeed's own launcher passes it; phalanx's do not
    parser.add_argument("--tag", default="")
    return parser.parse_args(argv)


def train_from_argv() -> dict[str, Any]:
    """:func:`train` with the config named by ``sys.argv`` (a DeepspeedTorchDistributor function's flags)."""
    args = parse(sys.argv[1:])
    return {**train(args.deepspeed_config), "deepspeed_flag": args.deepspeed, "tag": args.tag}


def main() -> None:
    print("ZERO " + json.dumps(train_from_argv()), flush=True)


if __name__ == "__main__":
    main()
