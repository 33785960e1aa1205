"""Squall topics in Spark: batch reads, a Structured Streaming source, and exactly-once writes.

Install with the `spark` extra (`pip install 'squall[spark]'`: pyspark >= 4.2 and
pyarrow; Spark needs Java 17 or later). PySpark finds the format by itself (the
`pyspark_squall` module, PySpark's convention for installed data sources), so no
registration is needed; `register(spark)` remains for sessions whose Python workers cannot
see the installed package::

    df = (spark.read.format("squall")
          .option("gateway", "127.0.0.1:7100").option("topic", "orders")
          .option("startingOffsets", "earliest").option("endingOffsets", "latest")
          .load())                       # topic, offset, key, payload, timestamp, ...

    stream = (spark.readStream.format("squall")
              .option("gateway", "127.0.0.1:7100").option("topic", "orders")
              .option("maxEventsPerTrigger", 10_000).load())

    (df.selectExpr("key", "payload").write.format("squall")
       .option("gateway", "127.0.0.1:7100").option("topic", "copy")
       .mode("append").save())

Spark runs this code in Python worker processes it starts itself: `PYSPARK_PYTHON` must
name an interpreter that can `import squall.spark` (the one you installed it into);
`local_session()` sets that up for local runs. The options, the columns, and what each
mode guarantees (batch and streaming writes store each row once across task retries and
micro-batch replays) are in docs/spark.md.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from squall.spark._options import (
    BATCH_EVENTS_DEFAULT,
    MAX_EVENTS_PER_SPLIT_DEFAULT,
    ROWS_PER_PUBLISHER_DEFAULT,
    publisher_id,
)
from squall.spark._reader import COLUMNS, SCHEMA, SCHEMA_DDL, OffsetRange
from squall.spark._source import SquallDataSource
from squall.spark._topic import SquallSparkError
from squall.spark._writer import WriteSummary

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "BATCH_EVENTS_DEFAULT",
    "COLUMNS",
    "MAX_EVENTS_PER_SPLIT_DEFAULT",
    "ROWS_PER_PUBLISHER_DEFAULT",
    "SCHEMA",
    "SCHEMA_DDL",
    "OffsetRange",
    "SquallDataSource",
    "SquallSparkError",
    "WriteSummary",
    "local_session",
    "make_discoverable",
    "publisher_id",
    "register",
]


def register(spark: SparkSession) -> None:
    """Registers the "squall" format with this session explicitly.

    Not needed where PySpark discovers it (the package installed where Spark's Python
    workers import from); harmless there too (Spark replaces the entry, with a warning).
    """
    spark.dataSource.register(SquallDataSource)


def make_discoverable() -> None:
    """Puts pyspark_squall where PySpark's data-source lookup looks, if it is not there.

    PySpark's lookup (a Python worker the JVM starts) lists top-level modules on its
    sys.path with pkgutil, which does not see modules an editable install (`pip install
    -e`) serves through an import hook. For such an install, the directory holding
    pyspark_squall goes on PYTHONPATH, which the JVM started afterwards passes on to its
    workers. A regular install needs nothing.
    """
    import importlib.util
    import pkgutil

    if any(module.name == "pyspark_squall" for module in pkgutil.iter_modules()):
        return
    spec = importlib.util.find_spec("pyspark_squall")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = os.path.dirname(next(iter(spec.submodule_search_locations)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, folder])


def local_session(
    app_name: str = "squall",
    *,
    cores: int = 2,
    task_attempts_max: int = 1,
    quick_jvm: bool = True,
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """A local-mode SparkSession on loopback where the squall format is found by PySpark.

    For development, demos, tests and benchmarks on one machine: Python workers use this
    interpreter, the driver binds to 127.0.0.1, the web UI is off, shuffles use `cores`
    partitions. `task_attempts_max` > 1 makes Spark retry failed tasks (plain `local[N]`
    never does). `quick_jvm` runs the JVM with its quick compiler only, which roughly
    halves start-up CPU on a small machine at some cost in long-run JVM speed.
    """
    from pyspark.sql import SparkSession

    # Workers are started by the JVM from these variables; they must import squall.spark.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    make_discoverable()
    builder = (
        SparkSession.builder.appName(app_name)
        .master(f"local[{cores},{task_attempts_max}]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.stopTimeout", "30s")
    )
    if quick_jvm:
        builder = builder.config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
