"""phalanx.torch.checkpoint in one process (DCP without a process group): markers, keep-last, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("fsspec")

from phalanx.errors import CheckpointError, InvalidArgumentError
from phalanx.torch.checkpoint import MARKER, Checkpointer, TrainState, step_dir


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), value)}


def test_keep_last_markers_and_a_half_written_step(tmp_path: Path) -> None:
    ckpt = Checkpointer(f"file://{tmp_path}", keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step))
    assert ckpt.steps() == [2, 3] and sorted(p.name for p in tmp_path.iterdir()) == [step_dir(2), step_dir(3)]
    (tmp_path / step_dir(9)).mkdir()  # a job died while writing step 9: no marker
    (tmp_path / step_dir(9) / "__0_0.distcp").write_bytes(b"half")
    assert ckpt.latest_step() == 3
    state = _state(0)
    assert ckpt.load(state) == 3 and state["w"].tolist() == [3.0] * 3
    with pytest.raises(CheckpointError, match=r"step 9 under .* \(complete steps: \[2, 3\]\)"):
        ckpt.load(state, step=9)
    ckpt.save(10, _state(10))  # a newer complete step: the half-written 9 goes, and so does step 2
    assert ckpt.steps() == [3, 10] and not (tmp_path / step_dir(9)).exists()
    assert (tmp_path / step_dir(10) / MARKER).is_file()


def test_resume_only_when_asked_and_never_overwrite_a_complete_step(tmp_path: Path) -> None:
    Checkpointer(str(tmp_path)).save(4, _state(4))
    state = _state(0)
    assert Checkpointer(str(tmp_path)).restore(state) == 0 and state["w"][0] == 0
    assert Checkpointer(str(tmp_path), resume=True).restore(state) == 4 and state["w"][0] == 4
    assert Checkpointer(str(tmp_path / "empty"), resume=True).restore(state) == 0
    with pytest.raises(InvalidArgumentError, match="step=4 is not newer"):
        Checkpointer(str(tmp_path)).save(4, _state(5))
    with pytest.raises(InvalidArgumentError, match="keep_last=0"):
        Checkpointer(str(tmp_path), keep_last=0)


def test_train_state_round_trip_with_an_async_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ckpt = Checkpointer(str(tmp_path))
    future = ckpt.save(1, {"app": TrainState(model, opt, step=1)}, async_save=True)
    assert future is not None
    ckpt.wait()
    assert future.done() and ckpt.steps() == [1]
    other = torch.nn.Linear(4, 2)
    other_opt = torch.optim.Adam(other.parameters())
    app = TrainState(other, other_opt, step=0)
    Checkpointer(str(tmp_path), resume=True).restore({"app": app})
    assert torch.equal(other.weight, model.weight) and app.extra["step"] == 1
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
