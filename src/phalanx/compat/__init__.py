"""Drop-in aliases: ``import horovod.torch as hvd`` is ``phalanx.torch``, ``horovod.run`` is ``phalanx.run``.

Also ``horovod.spark`` -> ``phalanx.spark``, ``horovod.tensorflow`` -> ``phalanx.tensorflow``,
``horovod.tensorflow.keras`` and ``horovod.keras`` -> ``phalanx.tensorflow.keras``,
``sparkdl.horovod.tensorflow.keras.LogCallback`` -> ``phalanx.spark.keras_log.LogCallback``,
``sparkdl.HorovodRunner`` and ``sparkdl.horovod.log_to_driver`` -> ``phalanx.spark``. The aliases apply
only where the real package is not importable (see ``_finder``).
They are active in every environment phalanx is pip-installed in: the wheel ships ``phalanx-compat.pth``,
whose one line calls ``_phalanx_startup.install_alias_hook``: a finder that imports this package only when
``horovod`` or ``sparkdl`` is first imported (start-up imports nothing). phalanx's worker entry calls
:func:`install`, so workers always have them.
"""

from __future__ import annotations

from phalanx.compat._finder import install, installed, uninstall

__all__ = ["install", "install_rank_hooks", "installed", "uninstall"]


def install_rank_hooks() -> None:
    """What every rank of a phalanx function job gets (the worker entry calls this): the aliases, and
    ``Trainer(strategy="horovod")`` once Lightning is imported (:mod:`phalanx.lightning.hook`, which imports
    nothing heavy). Command ranks get the latter from the wheel's ``phalanx-lightning.pth``."""
    install()
    from phalanx.lightning import hook

    hook.install()
