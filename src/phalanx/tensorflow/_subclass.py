"""The distributed subclass of a user's class: a mixin put in front of it, as Horovod's wrappers do."""

from __future__ import annotations

_MADE: dict[tuple[type, type], type] = {}


def mixed_in(mixin: type, base: type) -> type:
    """``base`` with ``mixin`` in front: a subclass with ``base``'s name and module, made once per pair (the
    same class every time); ``base`` itself when it already has ``mixin``."""
    if issubclass(base, mixin):
        return base
    if (mixin, base) not in _MADE:
        _MADE[mixin, base] = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    return _MADE[mixin, base]
