"""A rank's process set-up: ``state`` (the process group, this rank's ``RankIdentity``), ``membership``
(registering process sets at ``init``), ``log`` (``HOROVOD_LOG_LEVEL``), ``malloc`` (glibc's thresholds),
``observe`` (the rank's statistics).
"""
