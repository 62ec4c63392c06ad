"""Helpers of the training-side API: ``buckets`` (the optimizer's fusion buckets), ``sparse`` (sparse
gradients), ``autograd`` (the collectives' autograd Functions), ``durable`` (checkpoint files written whole),
``grad_trace`` (the gradients' timeline rows, one per tensor).
"""
