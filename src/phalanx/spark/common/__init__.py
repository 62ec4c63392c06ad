"""``horovod.spark.common`` on phalanx: the estimators' ``store`` (``from horovod.spark.common.store import
LocalStore`` resolves here)."""
