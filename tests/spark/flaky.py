"""A test-only `squall_flaky` format: the real squall writer, whose first task attempt dies.

Attempt 0 of partition 0 publishes `FAIL_AFTER_ROWS` rows for real (they are stored), then
raises, as an executor crash would. Spark retries the task (local[2,2]); the retry writes
the whole partition again under the same publisher ids and sequences. A marker file per
write id records how many rows the failed attempt handed to the publisher, so a test can
check that the failure happened before asserting that nothing was stored twice.

Spark's workers import this module by name (the repository root is on their PYTHONPATH).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceWriter
from pyspark.sql.types import StructType

from squall.spark import SquallDataSource, WriteSummary
from squall.spark._options import parse_write
from squall.spark._writer import SquallWriter

FAIL_AFTER_ROWS = 25
# Rows per Arrow batch handed to the writer, so the failure lands mid-partition.
SLICE_ROWS = 5


class InjectedFailure(RuntimeError):
    """The failure the flaky writer injects (an executor dying mid-partition)."""


def _marker(write_id: str) -> Path:
    return Path(os.environ["SQUALL_SPARK_TEST_DIR"]) / f"failed-{write_id}"


def rows_before_failure(write_id: str) -> int | None:
    """How many rows the failed attempt published, or None if no attempt failed."""
    path = _marker(write_id)
    return int(path.read_text()) if path.exists() else None


def _fail_midway(batches: Iterator[pa.RecordBatch], write_id: str) -> Iterator[pa.RecordBatch]:
    rows = 0
    for batch in batches:
        for start in range(0, batch.num_rows, SLICE_ROWS):
            if rows >= FAIL_AFTER_ROWS:
                _marker(write_id).write_text(str(rows))
                raise InjectedFailure(f"injected failure after {rows} rows")
            piece = batch.slice(start, SLICE_ROWS)
            rows += piece.num_rows
            yield piece


class FlakyWriter(SquallWriter):
    """SquallWriter whose first attempt at partition 0 fails after FAIL_AFTER_ROWS rows."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteSummary:
        context = TaskContext.get()
        if context is not None and context.partitionId() == 0 and context.attemptNumber() == 0:
            iterator = _fail_midway(iterator, self.write_id)
        return super().write(iterator)


class FlakySquallDataSource(SquallDataSource):
    """The squall format with a writer that fails once mid-partition."""

    @classmethod
    def name(cls) -> str:
        return "squall_flaky"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return FlakyWriter(parse_write(self.options), schema)
