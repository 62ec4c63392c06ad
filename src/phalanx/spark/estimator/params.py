"""The estimators' Spark ML parameters: Horovod's names and defaults (``horovod.spark.common.params``).

Each parameter has Horovod's ``getX`` / ``setX`` pair (``getBatchSize``, ``setBatchSize``...), generated from
one table so that a name, its default and its accessor cannot drift apart. Parameters Horovod has only for
Petastorm (``reader_pool_type``, ``train_reader_num_workers``...) are accepted and ignored, so that
Horovod code constructs unchanged; docs/migration.md lists them.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params

# name -> (default, doc). The defaults are Horovod's.
PARAMS: dict[str, tuple[object, str]] = {
    "num_proc": (None, "number of ranks (default: every task slot of the cluster)"),
    "model": (None, "the model to train"),
    "optimizer": (None, "the optimizer (torch: an instance over the model's parameters)"),
    "loss": (None, "the loss function, or one per label column"),
    "loss_weights": (None, "one weight per loss when there are several"),
    "metrics": ([], "metric functions metric(output, label) -> tensor, averaged over batches and ranks"),
    "store": (None, "the Store for the run's data, checkpoints and logs"),
    "feature_cols": (None, "feature column names, one per input of the model"),
    "label_cols": (None, "label column names, one per output of the model"),
    "input_shapes": (None, "shape of each input, the batch dimension first as -1"),
    "sample_weight_col": (None, "column with each row's weight in the loss"),
    "validation": (None, "a fraction of the rows in [0, 1), or the name of a 0/1 column"),
    "callbacks": ([], "callbacks (Keras, Lightning; torch: called with (epoch, metrics) after each epoch)"),
    "batch_size": (32, "rows per training batch on each rank"),
    "val_batch_size": (None, "rows per validation batch (default: batch_size)"),
    "epochs": (1, "number of epochs"),
    "verbose": (1, "0 silent, 1 one line per epoch, 2 also per step"),
    "random_seed": (None, "seed of the model's initialisation and of the shuffling"),
    "shuffle": (True, "shuffle the training rows every epoch"),
    "partitions_per_process": (10, "Parquet files written per rank"),
    "run_id": (None, "the run's id in the store; an interrupted run's id resumes it"),
    "train_steps_per_epoch": (None, "training batches per epoch (default: rows / (batch_size * ranks))"),
    "validation_steps_per_epoch": (None, "validation batches per epoch (default: all validation rows)"),
    "transformation_fn": (None, "a function applied to each batch (a dict column -> NumPy array)"),
    "use_gpu": (True, "train on GPUs when Spark gives the tasks GPUs"),
    "gradient_compression": (None, "compression of the gradients (hvd.Compression)"),
    "label_shapes": (None, "shape of each label, the batch dimension first as -1"),
    "backend": (None, "a SparkBackend: its num_proc is the number of ranks (give it or num_proc, not both)"),
    "compress_sparse_cols": (False, "ignored: sparse vectors are stored dense"),
    "shuffle_buffer_size": (None, "ignored (deprecated in Horovod): rows are shuffled per row group"),
    "train_reader_num_workers": (2, "ignored: one pyarrow reader per rank"),
    "val_reader_num_workers": (2, "ignored: one pyarrow reader per rank"),
    "reader_pool_type": ("thread", "ignored: one pyarrow reader per rank"),
    "inmemory_cache_all": (False, "ignored: the rows stream from the store"),
    "mp_start_method": (None, "ignored: ranks are phalanx worker processes"),
}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


class EstimatorParams(Params):
    """The parameters every estimator shares, with ``getX`` / ``setX`` accessors."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**{name: default for name, (default, _) in PARAMS.items()})

    def setParams(self, **kwargs: object) -> EstimatorParams:
        """Set several parameters at once."""
        return self._set(**kwargs)

    def value(self, name: str) -> Any:
        """The value of parameter ``name`` (set or default): a setting, or the user's model, optimizer, loss or
        callbacks, hence ``Any``."""
        return self.getOrDefault(getattr(self, name))


def add_params(cls: type, table: dict[str, tuple[object, str]]) -> None:
    """Give ``cls`` a ``Param`` attribute and Horovod's ``getX`` / ``setX`` for every entry of ``table``."""
    for name, (_, doc) in table.items():
        setattr(cls, name, Param(Params._dummy(), name, doc))

        def getter(self: Params, _name: str = name) -> object:
            return self.getOrDefault(getattr(self, _name))

        def setter(self: Params, value: object, _name: str = name) -> Params:
            return self._set(**{_name: value})

        getter.__doc__ = f"The value of ``{name}``: {doc}."
        setter.__doc__ = f"Set ``{name}``: {doc}."
        setattr(cls, f"get{_camel(name)}", getter)
        setattr(cls, f"set{_camel(name)}", setter)


add_params(EstimatorParams, PARAMS)
