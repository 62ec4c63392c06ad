"""A job on a Spark Connect session: a client with no SparkContext, whose executors may not reach it.

The job is one barrier ``mapInArrow`` query whose rank 0 task hosts what a classic driver hosts.

- :mod:`~phalanx.spark.connect.client`: the client (:class:`~phalanx.spark.connect.client.ConnectLauncher`).
- :mod:`~phalanx.spark.connect.task`: the task each rank runs in the query.
- :mod:`~phalanx.spark.connect.host`: the driver side, run inside rank 0's task.
- :mod:`~phalanx.spark.connect.wire`: the signed result rows the tasks send back.
- :mod:`~phalanx.spark.connect.session`: what a Connect session tells (is it one, its slots, the client's
  address).
"""
