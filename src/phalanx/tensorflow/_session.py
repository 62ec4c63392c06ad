"""TensorFlow 1 sessions raise a failed collective's error with Horovod's TensorFlow type.

TensorFlow reports any Python exception raised inside a ``tf.numpy_function`` as ``UnknownError``; Horovod's
ops fail with ``FailedPreconditionError`` when ranks disagree, and scripts catch that type. ``install`` wraps
``Session.run`` (once) so that such an error is raised as ``_bridge.TFCollectiveMismatchError``, which is both
that type and phalanx's ``CollectiveMismatchError``; every other error passes through unchanged.
"""

from __future__ import annotations

import functools

from tensorflow.python.client import session

from phalanx.tensorflow import _bridge


def install() -> None:
    """Wrap ``BaseSession.run`` (idempotent)."""
    original = session.BaseSession.run
    if getattr(original, "_phalanx_typed_errors", False):
        return

    @functools.wraps(original)
    def run(self: session.BaseSession, *args: object, **kwargs: object) -> object:
        try:
            return original(self, *args, **kwargs)
        except Exception as e:
            typed = _bridge.typed_op_error(e)
            if typed is e:
                raise
            raise typed from e

    run._phalanx_typed_errors = True  # type: ignore[attr-defined]
    session.BaseSession.run = run
