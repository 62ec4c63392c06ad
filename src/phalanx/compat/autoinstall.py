"""``import phalanx.compat.autoinstall`` installs the alias finder at once (e.g. from a sitecustomize).

The ``phalanx-compat.pth`` hook shipped in the wheel does not import this: it calls
``_phalanx_startup.install_alias_hook``, whose finder imports :mod:`phalanx.compat` only when ``horovod`` or
``sparkdl`` is first imported, so interpreter start-up imports nothing of phalanx.
"""

from __future__ import annotations

try:
    from phalanx.compat._finder import install

    install()
except Exception:  # a broken alias must never break the importing program
    pass
