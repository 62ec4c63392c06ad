"""`make demo`: the main job on the embedded default.

Runs the HorovodRunner digits example (examples/spark_digits.py) on an embedded local Spark session when
that example exists, else the DDP digits example on 2 local processes.
"""

from __future__ import annotations

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    spark_demo = os.path.join(HERE, "spark_digits.py")
    target = spark_demo if os.path.exists(spark_demo) else os.path.join(HERE, "local_ddp_digits.py")
    sys.argv = [target, *sys.argv[1:]]
    runpy.run_path(target, run_name="__main__")
