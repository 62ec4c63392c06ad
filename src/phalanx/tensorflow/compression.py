"""Gradient compression for TensorFlow tensors (Horovod's ``hvd.Compression``): ``none`` and ``fp16``."""

from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface: compress a tensor before a collective and decompress the result."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, object]:
        """Return the tensor to send and a context for :meth:`decompress`."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: object) -> tf.Tensor:
        """Undo :meth:`compress` on the collective's result."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, object]:
        """Return ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: object) -> tf.Tensor:
        """Return ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and are cast back; other dtypes are untouched."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, object]:
        """Cast a floating-point tensor to float16; the context is the original dtype."""
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: object) -> tf.Tensor:
        """Cast back to the original dtype."""
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
