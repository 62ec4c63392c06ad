"""The demo's training (``examples/spark_digits.py``) from a Spark Connect client.

Spark Connect (``SparkSession.builder.remote(...)``) is Spark's thin client: the notebook or laptop holds no
SparkContext, and the cluster's executors may be unable to connect back to it. phalanx runs the job as one
barrier ``mapInArrow`` query whose rank 0 task hosts the rendezvous; rank 0's value (or the root-cause
error) and, when the executors cannot reach the client, every rank's log come back with the query result.

With no active Spark Connect session this starts a local one (``remote("local[2]")``: a Connect server in
this process; needs ``pip install 'phalanx[connect]'`` and Java). Nothing is downloaded.

    .venv/bin/python examples/spark_connect_digits.py [--remote sc://host:15002] [--np 2] [--epochs 10]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from spark_digits import train_hvd

from phalanx.spark import HorovodRunner


def connect_session(remote: str) -> Any:
    """The active Spark Connect session, or a new one at ``remote`` (``local[N]`` starts a local server)."""
    from pyspark.sql import SparkSession
    from pyspark.sql.utils import is_remote

    active = SparkSession.getActiveSession()
    if active is not None and is_remote():
        return active
    return SparkSession.builder.remote(remote).getOrCreate()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--remote", default="local[2]", help="Spark Connect URL (default: a local server)")
    parser.add_argument("--np", type=int, default=2, help="ranks (barrier tasks; default 2)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "digits_cnn.pt"),
                        help="where rank 0 saves the model (on its executor; default: its temporary directory)")
    args = parser.parse_args(argv)
    session = connect_session(args.remote)
    print(f"Spark Connect session {type(session).__module__} ({args.remote})")
    result: dict[str, Any] = HorovodRunner(np=args.np).run(train_hvd, epochs=args.epochs,
                                                             out=os.path.abspath(args.out))
    print(f"test accuracy: {result['accuracy']:.3f} ({result['size']} ranks over Spark Connect)")
    return result


if __name__ == "__main__":
    final = main()
    if final["accuracy"] < 0.9:
        raise SystemExit(f"test accuracy {final['accuracy']:.3f} is below 0.9")
