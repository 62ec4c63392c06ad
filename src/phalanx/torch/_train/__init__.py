"""Helpers of the training-side API: ``buckets`` (the optimizer's fusion buckets), ``sparse`` (sparse
gradients), ``autograd`` (the collectives' autograd Functions), ``durable`` (checkpoint files written whole).
"""
