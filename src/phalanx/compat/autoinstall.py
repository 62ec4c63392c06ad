"""Imported by ``phalanx-compat.pth`` at interpreter start: installs the alias finder, never fails."""

from __future__ import annotations

try:
    from phalanx.compat._finder import install

    install()
except Exception:  # a broken alias must never break the interpreter's start-up
    pass
