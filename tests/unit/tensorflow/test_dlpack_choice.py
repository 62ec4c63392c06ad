"""Which TensorFlow tensors take the DLPack route (``PHALANX_TF_DLPACK``): tensors on a GPU by default, every
tensor or none when told; a bad value is an error naming the variable. (The route's results: the 2-rank test
tests/multiprocess/tensorflow/test_tf_dlpack.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("tensorflow")

from phalanx.env import settings
from phalanx.errors import SettingError

# white-box: the zero-copy bridge's choice, internal to the TF front end (no public name)
from phalanx.tensorflow import _dlpack


@dataclass
class _Eager:
    device: str


GPU = _Eager("/job:localhost/replica:0/task:0/device:GPU:1")
CPU = _Eager("/job:localhost/replica:0/task:0/device:CPU:0")


def test_gpu_tensors_take_the_route_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_TF_DLPACK", raising=False)
    assert _dlpack.wanted([CPU, GPU]) and not _dlpack.wanted([CPU])
    for value, cpu, gpu in (("auto", False, True), ("1", True, True), ("on", True, True), ("0", False, False),
                            ("false", False, False)):
        monkeypatch.setenv("PHALANX_TF_DLPACK", value)
        assert (_dlpack.wanted([CPU]), _dlpack.wanted([GPU])) == (cpu, gpu), value
    monkeypatch.setenv("PHALANX_TF_DLPACK", "gpu")
    with pytest.raises(SettingError, match=r"PHALANX_TF_DLPACK='gpu' is not auto or a boolean"):
        settings.TF_DLPACK.get()
