"""phalanx.lightning without worker processes: op and device rules, the GPU branch with fakes, the 1.x
spelling, and registration (in fresh interpreters: the hook acts at import time)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from phalanx.errors import InvalidArgumentError
from phalanx.lightning import registry
from phalanx.lightning import strategy as hvd_strategy

pytest.importorskip("lightning")


def test_reduce_ops_map_to_hvd_ops() -> None:
    import phalanx.torch as hvd

    assert hvd_strategy.hvd_op(None) == hvd_strategy.hvd_op("mean") == hvd_strategy.hvd_op("avg") == hvd.Average
    assert hvd_strategy.hvd_op("sum") == hvd_strategy.hvd_op(torch.distributed.ReduceOp.SUM) == hvd.Sum
    assert hvd_strategy.hvd_op(torch.distributed.ReduceOp.MAX) == hvd.Max
    assert hvd_strategy.hvd_op("min") == hvd.Min
    with pytest.raises(InvalidArgumentError, match="unsupported reduce_op 'bxor'"):
        hvd_strategy.hvd_op("bxor")


def test_root_device_is_the_local_ranks_gpu_or_the_cpu() -> None:
    gpus = [torch.device("cuda", i) for i in range(4)]
    assert hvd_strategy.root_device_of(gpus, 3) == torch.device("cuda", 3)
    # devices=1, 2 ranks per host
    assert hvd_strategy.root_device_of([torch.device("cuda", 0)], 1) == torch.device("cuda", 1)
    assert hvd_strategy.root_device_of([torch.device("cpu")], 1) == torch.device("cpu")
    assert hvd_strategy.root_device_of(None, 0) == torch.device("cpu")


class FakeHvd:
    """The rank functions of hvd for a rank that is local rank 1 of 2 on the second of 2 hosts."""

    def init(self) -> None:
        pass

    def rank(self) -> int:
        return 3

    def local_rank(self) -> int:
        return 1

    def size(self) -> int:
        return 4

    def cross_rank(self) -> int:
        return 1


def test_gpu_branch_pins_the_local_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built as the Trainer builds it on a 2-GPU host; CUDA calls are recorded instead of made."""
    monkeypatch.setattr(hvd_strategy, "hvd", FakeHvd())
    pinned: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    strategy: Any = hvd_strategy.strategy_class("lightning.pytorch")(parallel_devices=[torch.device("cuda", 0),
                                                                          torch.device("cuda", 1)])
    moved: list[torch.device] = []
    strategy._model = SimpleNamespace(to=moved.append)
    assert (strategy.global_rank, strategy.local_rank, strategy.world_size, strategy.node_rank) == (3, 1, 4, 1)
    assert not strategy.is_global_zero
    assert strategy.root_device == torch.device("cuda", 1)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}
    strategy.model_to_device()
    assert pinned == moved == [torch.device("cuda", 1)]


def test_learning_rates_and_scheduler_base_rates_scale_with_the_world() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    hvd_strategy.scale_learning_rates([optimizer], [SimpleNamespace(scheduler=scheduler)], 4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)
    assert scheduler.base_lrs == [pytest.approx(0.4)]


def test_v1_spelling_becomes_the_strategy() -> None:
    flags = registry.translate({"accelerator": "horovod", "devices": 1})
    assert flags == {"accelerator": "auto", "strategy": "horovod", "devices": 1}
    assert registry.translate({"accelerator": "cpu", "strategy": "ddp"}) == {"accelerator": "cpu", "strategy": "ddp"}
    with pytest.raises(InvalidArgumentError, match=r"strategy='ddp'.*Trainer\(strategy=\"horovod\"\)"):
        registry.translate({"accelerator": "horovod", "strategy": "ddp"})


def test_unknown_flavour_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'lightning\.fabric'"):
        hvd_strategy.strategy_class("lightning.fabric")


def _python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "HOROVOD_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.fixture
def one_rank(no_launcher: None) -> Iterator[None]:
    import phalanx.torch as hvd

    yield
    hvd.shutdown()


def _fit(pl: Any, **flags: Any) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    class M(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **flags)
    trainer.fit(M(), data)
    return trainer


@pytest.mark.timeout(120)
def test_both_spellings_fit_on_one_rank_after_the_import(one_rank: None) -> None:
    """``import phalanx.lightning`` registers with ``lightning.pytorch`` (before or after its import); with no
    launcher hvd.init() makes one rank."""
    import phalanx.lightning

    pl = importlib.import_module("lightning.pytorch")
    cls = phalanx.lightning.HorovodStrategy
    for flags in ({"strategy": "horovod"}, {"accelerator": "horovod"}, {"strategy": cls()}):
        trainer = _fit(pl, **flags)
        assert type(trainer.strategy) is cls and trainer.global_step == 2
        assert trainer.strategy.root_device == torch.device("cpu")
    with pytest.raises(InvalidArgumentError, match=r"strategy='ddp'.*Trainer\(strategy=\"horovod\"\)"):
        pl.Trainer(accelerator="horovod", strategy="ddp")


FAKE_FLAVOUR = {  # the two modules of a flavour that registration touches (real flavours: tests/multiprocess)
    "pytorch_lightning/__init__.py": "",
    "pytorch_lightning/strategies/__init__.py": (
        "class _Registry(dict):\n"
        "    def register(self, name, strategy, description='', **init_params):\n"
        "        self[name] = {'strategy': strategy, 'init_params': init_params}\n"
        "StrategyRegistry = _Registry()\n"),
    "pytorch_lightning/trainer/__init__.py": "",
    "pytorch_lightning/trainer/connectors/__init__.py": "",
    "pytorch_lightning/trainer/connectors/accelerator_connector.py": (
        "class _AcceleratorConnector:\n"
        "    def __init__(self, devices='auto', accelerator='auto', strategy='auto'):\n"
        "        self.flags = (accelerator, strategy)\n"),
}


def test_inside_a_job_a_flavour_gets_it_when_imported_without_the_import(tmp_path: Path) -> None:
    """The wheel's start-up hook (``phalanx-lightning.pth``) registers with a flavour imported later, and
    makes its Trainer take ``accelerator="horovod"``; without the job's run id nothing happens."""
    for name, text in FAKE_FLAVOUR.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import pytorch_lightning.strategies as s; "
            "import pytorch_lightning.trainer.connectors.accelerator_connector as a; "
            "print('horovod' in s.StrategyRegistry, a._AcceleratorConnector(accelerator='horovod').flags)")
    assert _python(code, PHALANX_RUN_ID="unit-test") == "True ('auto', 'horovod')"
    assert _python(code) == "False ('horovod', 'auto')"


def test_start_up_hook_costs_nothing_outside_a_job_and_little_inside() -> None:
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith(('phalanx', 'torch', 'lightning'))))"
    assert _python(code) == "[]"
    inside = _python(code, PHALANX_RUN_ID="unit-test")
    assert "'phalanx.lightning.hook'" in inside and "torch" not in inside and "'lightning" not in inside
