"""PySpark's discovery hook for the "squall" format (installed with `squall[spark]`).

PySpark 4 registers, in every session, the Python data sources of installed top-level
modules named `pyspark_*` that define `DefaultSource` (a `DataSource` subclass; the
format's name is its `name()`): see the module pyspark.sql.worker.lookup_data_sources.
So with the spark extra installed, `spark.read.format("squall")` works without
`register()`.
"""

from squall.spark._source import SquallDataSource as DefaultSource

__all__ = ["DefaultSource"]
