"""Horovod's gradient groups (``num_groups`` / ``groups``), shared by the optimizers and the gradient tape."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Union

from phalanx.errors import InvalidArgumentError

if TYPE_CHECKING:
    import keras

    from phalanx.tensorflow.tf_types import VariableLike

#: Horovod's gradient groups once read: a count, or lists of variables (only hashed and printed here).
Groups = int | tuple[tuple[object, ...], ...]
#: Horovod's ``groups=`` as given: None, a count, or lists of variables.
GroupsOption = int | Iterable[Iterable[object]] | None
#: Horovod's ``local_layers=``: a Keras layer, several, or None.
LocalLayers = Union["keras.layers.Layer", Iterable["keras.layers.Layer"], None]


def partition(keys: Sequence[Hashable], groups: Groups,
              key: Callable[[object], Hashable]) -> list[list[int]]:
    """Horovod's gradient groups as lists of positions (each group is fused into its own buffers).

    An int splits the gradients, in order, into that many groups of nearly equal counts; lists of variables
    put each list's variables in one group, and every other variable in a group of its own (Horovod's rule).

    Raises:
        InvalidArgumentError: a variable of ``groups`` is not one the optimizer applies gradients to.
    """
    if isinstance(groups, int):
        n = max(1, min(groups, len(keys)))
        bounds = [len(keys) * g // n for g in range(n + 1)]
        return [list(range(bounds[g], bounds[g + 1])) for g in range(n)]
    where = {k: i for i, k in enumerate(keys)}
    out, placed = [], set()
    for group in groups:
        idx = []
        for v in group:
            if key(v) not in where:
                raise InvalidArgumentError(f"DistributedOptimizer(groups=...) names variable {label(v)!r}, "
                                           "which this optimizer does not train")
            idx.append(where[key(v)])
        out.append(sorted(idx))
        placed.update(idx)
    return out + [[i] for i in range(len(keys)) if i not in placed]


def check_groups(groups: Groups) -> None:
    if isinstance(groups, bool) or (isinstance(groups, int) and groups < 0):
        raise InvalidArgumentError(f"num_groups / groups must be an int >= 0 or lists of variables; got {groups!r}")
    if isinstance(groups, int):
        return
    seen: set[int] = set()
    for group in groups:
        for v in group:
            if id(v) in seen:
                raise InvalidArgumentError(f"DistributedOptimizer(groups=...) lists variable {label(v)!r} "
                                           "in more than one group")
            seen.add(id(v))


def label(variable: object) -> str:
    return str(getattr(variable, "path", variable))


def groups_option(num_groups: int, groups: GroupsOption) -> Groups:
    """Horovod's two spellings as one value: ``num_groups`` (deprecated there) or ``groups`` (int or lists)."""
    if num_groups and groups is not None:
        raise InvalidArgumentError(f"pass num_groups={num_groups!r} or groups=..., not both (num_groups is "
                                   "Horovod's deprecated spelling of groups=<int>)")
    value = num_groups if groups is None else groups
    if isinstance(value, int):
        return value  # checked (bool, negative) by _check_groups
    try:
        return tuple(tuple(g) for g in value)
    except TypeError:
        raise InvalidArgumentError(
            f"num_groups / groups must be an int >= 0 or lists of variables; got {value!r}") from None


def local_layer_variables(local_layers: LocalLayers) -> list[VariableLike]:
    """The trainable weights of Horovod's ``local_layers`` (one Keras layer or several).

    Raises:
        InvalidArgumentError: an entry is not a Keras layer.
    """
    from phalanx.tensorflow import keras_flavour

    keras = keras_flavour.keras()
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise InvalidArgumentError(f"All local layers must be of keras.layers.Layer type; got "
                                       f"{type(layer).__name__}")
    return [v for layer in layers for v in layer.trainable_weights]
