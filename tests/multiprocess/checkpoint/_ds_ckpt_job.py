"""A DeepSpeed job for the checkpoint tests: ZeRO 2 and 3 on CPU (gloo), saved in DeepSpeed's own format
through ``DeepSpeedCheckpointer`` and loaded into fresh engines."""

from __future__ import annotations

from typing import Any

STEPS = 4


def _engine(stage: int, seed: int) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine: Any, step: int) -> None:
    import torch

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + engine.global_rank))
    engine.backward((engine(x) - x.sum(dim=1, keepdim=True)).pow(2).mean())
    engine.step()


def _weights(engine: Any) -> list[float]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [float(v) for p in params for v in p.detach().reshape(-1)]


def stage_round_trip(url: str, stage: int) -> dict[str, Any]:
    """Train 4 steps saving after steps 2, 3 and 4 (keep 2), then one more step; a fresh engine (another
    seed) resumes from the newest step and takes that same step: weights and optimizer state must match."""
    from phalanx.torch.deepspeed_checkpoint import DeepSpeedCheckpointer

    engine = _engine(stage, seed=0)
    ckpt = DeepSpeedCheckpointer(url, keep_last=2, resume=True)
    assert ckpt.restore(engine) == (0, {})  # nothing stored yet
    for step in range(1, STEPS + 1):
        _step(engine, step)
        if step >= 2:
            ckpt.save(engine, step, client_state={"data_position": step * 8})
    saved = _weights(engine)
    _step(engine, STEPS + 1)
    after = _weights(engine)
    engine.destroy()

    fresh = _engine(stage, seed=1)
    step, client_state = DeepSpeedCheckpointer(url, resume=True).restore(fresh)
    restored = _weights(fresh)
    _step(fresh, STEPS + 1)
    resumed = _weights(fresh)
    fresh.destroy()
    return {"steps": ckpt.steps(), "step": step, "client": client_state.get("data_position"),
            "restored_exact": restored == saved, "next_step_exact": resumed == after, "moved": saved != after}


def job(local_url: str, s3_url: str) -> dict[str, Any]:
    """ZeRO-2 to a local directory, ZeRO-3 to S3; then a save to a bucket that does not exist."""
    import deepspeed

    from phalanx.errors import CheckpointError
    from phalanx.torch.deepspeed_checkpoint import DeepSpeedCheckpointer

    deepspeed.init_distributed(dist_backend="gloo")
    out = {"zero2": stage_round_trip(local_url, 2), "zero3": stage_round_trip(s3_url, 3)}
    engine = _engine(2, seed=0)
    try:
        DeepSpeedCheckpointer("s3://no-such-bucket/run").save(engine, 1)
    except CheckpointError as e:
        out["error"] = str(e)
    engine.destroy()
    return out
