"""The interpreter start-up hooks (``_phalanx_startup``, what the wheel's ``.pth`` files call), in one process
and in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import _phalanx_startup as startup
from phalanx.env import names

SRC = Path(startup.__file__).parent


@pytest.fixture
def meta_path() -> Iterator[None]:
    saved = list(sys.meta_path)
    yield
    sys.meta_path[:] = saved


def test_each_pth_file_is_one_import_of_the_startup_module() -> None:
    calls = {"phalanx-compat.pth": "install_alias_hook", "phalanx-shm-native.pth": "install_shm_native_hook",
             "phalanx-lightning.pth": "install_lightning_hook"}
    for pth, call in calls.items():
        lines = (SRC / pth).read_text().splitlines()
        assert lines == [f"import _phalanx_startup; _phalanx_startup.{call}()"], pth


def test_the_run_id_variable_is_the_env_layers() -> None:
    assert startup.RUN_ID_VARIABLE == names.PHALANX_RUN_ID


def test_hooks_decline_every_other_name(meta_path: None) -> None:
    startup.install_alias_hook()
    startup.install_shm_native_hook({startup.RUN_ID_VARIABLE: "job"})
    assert startup.PhalanxLazyAliasHook.find_spec("json") is None
    assert startup.PhalanxShmNativeHook.find_spec("torch") is None
    assert startup.PhalanxLazyAliasHook in sys.meta_path and startup.PhalanxShmNativeHook in sys.meta_path


def test_installing_twice_keeps_one_hook(meta_path: None) -> None:
    startup.install_alias_hook()
    startup.install_alias_hook()
    assert sys.meta_path.count(startup.PhalanxLazyAliasHook) == 1


def test_the_lightning_hook_is_installed_only_in_a_rank_of_a_job(meta_path: None) -> None:
    from phalanx.lightning import hook

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_AfterLightning"]
    startup.install_lightning_hook({})
    assert not hook.installed()
    startup.install_lightning_hook({startup.RUN_ID_VARIABLE: "job"})
    assert hook.installed()


def test_the_shm_hook_is_installed_only_in_a_rank_of_a_job(meta_path: None) -> None:
    startup.install_shm_native_hook({})
    assert startup.PhalanxShmNativeHook not in sys.meta_path
    startup.install_shm_native_hook({startup.RUN_ID_VARIABLE: "job"})
    assert sys.meta_path[0] is startup.PhalanxShmNativeHook


def _fresh(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_shm_hook_fires_on_the_first_import_of_torch_distributed() -> None:
    code = (
        "import sys, _phalanx_startup as s\n"
        "s.install_shm_native_hook({'PHALANX_RUN_ID': 'job'})\n"
        "import torch.distributed as dist\n"
        "print(s.PhalanxShmNativeHook in sys.meta_path, "
        "getattr(dist.init_process_group, '__phalanx_shm_wrapped__', False))"
    )
    assert _fresh(code, {"PATH": "/usr/bin:/bin"}) == "False True"


def test_the_alias_hook_fires_on_the_first_import_of_horovod() -> None:
    code = (
        "import sys, _phalanx_startup as s\n"
        "s.install_alias_hook()\n"
        "print('phalanx' in sys.modules)\n"
        "import horovod.torch as hvd, phalanx.torch\n"
        "print(hvd is phalanx.torch, s.PhalanxLazyAliasHook in sys.meta_path)"
    )
    assert _fresh(code, {"PATH": "/usr/bin:/bin"}) == "False\nTrue False"
