"""``TransformSpec``: Petastorm's hook that edits each stretch of rows (a pandas DataFrame) as it is read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from phalanx.errors import InvalidArgumentError, UsageError

if TYPE_CHECKING:
    import pandas as pd


class TransformSpec:
    """Petastorm's ``petastorm.transform.TransformSpec``: ``func`` maps a pandas DataFrame of rows to another
    (decode images from bytes, pad arrays...), then ``removed_fields`` are dropped and, when given, only
    ``selected_fields`` are kept, in that order.

    Args:
        func: ``DataFrame -> DataFrame``, or None.
        edit_fields: Petastorm's ``(name, numpy_dtype, shape, is_nullable)`` tuples of the columns ``func``
            adds or changes; phalanx reads the types from the data, and checks only that they are named.
        removed_fields: columns to drop after ``func``.
        selected_fields: the columns to keep after ``func``, in order.
    """

    def __init__(self, func: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
                 edit_fields: Sequence[Sequence[object]] | None = None,
                 removed_fields: Sequence[str] | None = None, selected_fields: Sequence[str] | None = None) -> None:
        if func is not None and not callable(func):
            raise InvalidArgumentError(f"TransformSpec func={func!r} is not callable; give a function of a DataFrame")
        self.func = func
        self.edit_fields = [tuple(f) for f in edit_fields or ()]
        if any(not f or not isinstance(f[0], str) for f in self.edit_fields):
            raise InvalidArgumentError(f"TransformSpec edit_fields={edit_fields!r}: give (name, dtype, shape, "
                                       "is_nullable) tuples")
        self.removed_fields = list(removed_fields or ())
        self.selected_fields = None if selected_fields is None else list(selected_fields)

    def apply(self, frame: pd.DataFrame) -> pd.DataFrame:
        """``frame`` transformed (see the class docstring).

        Raises:
            UsageError: ``func`` returned something other than a DataFrame, or a selected column is missing.
        """
        if self.func is not None:
            frame = self.func(frame)
            if not hasattr(frame, "columns"):
                raise UsageError(f"the transform_spec func returned a {type(frame).__name__}; it must return a "
                                 "pandas DataFrame")
        frame = frame.drop(columns=[c for c in self.removed_fields if c in frame.columns])
        if self.selected_fields is not None:
            missing = [c for c in self.selected_fields if c not in frame.columns]
            if missing:
                raise UsageError(f"transform_spec selected_fields {missing} are not among the transformed "
                                 f"columns {list(frame.columns)}")
            frame = frame[self.selected_fields]
        return frame
