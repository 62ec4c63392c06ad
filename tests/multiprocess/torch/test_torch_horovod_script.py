"""An unchanged Horovod-style training function runs under phalanx.run via the ``horovod`` alias."""

from __future__ import annotations

from pathlib import Path

import pytest

import phalanx

pytestmark = [pytest.mark.multiprocess]


def _horovod_style_training() -> tuple[bool, bool]:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
    checksum = hvd.allreduce(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum(), op=hvd.Max)
    mine = float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).sum())
    hvd.shutdown()
    return hvd.__name__ == "phalanx.torch", float(checksum) == mine


@pytest.mark.timeout(120)
def test_unchanged_horovod_script_runs_and_records_a_timeline(tmp_path: Path) -> None:
    trace = tmp_path / "timeline.json"
    out = phalanx.run(_horovod_style_training, np=2, env={"HOROVOD_TIMELINE": str(trace)})
    assert out == [(True, True), (True, True)]
    text = trace.read_text()
    for event in ("NEGOTIATE_BROADCAST", "BROADCAST", "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                  "allreduce.weight", "allreduce.bias", "ALLREDUCE"):  # Horovod's row per gradient
        assert event in text, event
