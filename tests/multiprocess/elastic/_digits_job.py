"""An elastic training job on scikit-learn's digits, shared by the elastic tests and ``bench/soak.py``.

Each step's batch depends only on the step number and the rank, so a run that loses a worker and
replays from its last commit trains on the same batches as an undisturbed run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

N_TRAIN = 1400
BATCH_PER_RANK = 32


def load_data() -> tuple[Any, Any]:
    """The digits as numpy arrays (load on the driver: importing scikit-learn costs workers seconds)."""
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)  # type: ignore[no-any-return]


def _split(data: tuple[Any, Any]) -> tuple[Any, Any, Any, Any]:
    import torch

    xt = torch.tensor(data[0] / 16.0, dtype=torch.float32)
    yt = torch.tensor(data[1], dtype=torch.long)
    return xt[:N_TRAIN], yt[:N_TRAIN], xt[N_TRAIN:], yt[N_TRAIN:]


def _maybe_die(step: int, kill_at: int | None, victim: int, marker: str | None, kill_task: bool = False,
               note: str | None = None) -> None:
    import phalanx.torch as hvd

    if kill_at is None or step != kill_at or hvd.rank() != victim or marker is None:
        return
    if Path(marker).exists():
        return
    Path(marker).write_text(note or str(os.getpid()))
    # kill_task: the Spark task supervising this worker dies (as with a lost executor); the worker follows.
    os.kill(int(os.environ["PHALANX_PARENT_PID"]) if kill_task else os.getpid(), signal.SIGKILL)


def train(data: tuple[Any, Any], steps: int = 60, commit_every: int = 5, kill_at: int | None = None, victim: int = 1,
          marker: str | None = None, seed: int = 0, kill_task: bool = False,
          distributed_optimizer: bool = False, kill_task_at: int | None = None) -> dict[str, Any]:
    """Train a tiny MLP on ``data`` (:func:`load_data`), committing every ``commit_every`` steps.

    Rank ``victim`` SIGKILLs itself (``kill_task``: its Spark task) at the start of step ``kill_at`` unless
    ``marker`` exists (once). With ``kill_task_at`` too, rank ``victim`` then kills its Spark task at the start
    of that step unless ``<marker>.task`` exists, writing there the step its process started at. Gradients
    are averaged with ``hvd.grouped_allreduce``, or by ``hvd.DistributedOptimizer`` with
    ``distributed_optimizer``.

    Returns:
        ``acc`` (test accuracy, %), ``executed`` (steps this process ran, replays included), ``commits``,
        ``resumed_from`` (the step the first call started at: > 0 after a durable resume), ``rank``, ``size``.
    """
    import torch

    import phalanx.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = _split(data)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed_optimizer:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)
    executed = [0]
    resumed_from: list[int] = []

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> float:
        resumed_from.append(state.step)
        while state.step < steps:
            _maybe_die(state.step, kill_at, victim, marker, kill_task)
            if kill_task_at is not None and marker is not None:
                _maybe_die(state.step, kill_task_at, victim, f"{marker}.task", True, str(resumed_from[0]))
            gen = torch.Generator().manual_seed(seed * 100003 + state.step)
            idx = torch.randint(0, N_TRAIN, (BATCH_PER_RANK * hvd.size(),), generator=gen)[hvd.rank()::hvd.size()]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            if not distributed_optimizer:
                grads = [p.grad for p in model.parameters()]
                for p, g in zip(model.parameters(), hvd.grouped_allreduce(grads, op=hvd.Average)):
                    p.grad = g
            opt.step()
            state.step += 1
            executed[0] += 1
            if state.step % commit_every == 0:
                state.commit()
        with torch.no_grad():
            return float((model(xte).argmax(1) == yte).float().mean()) * 100.0

    acc = loop(state)
    return {"acc": acc, "executed": executed[0], "commits": state.commits,
            "resumed_from": resumed_from[0], "rank": hvd.rank(), "size": hvd.size()}
