"""Writing DataFrames into a topic, each row stored once however often Spark retries.

Every Spark task publishes its partition through its own client, created on the executor.
Its rows are numbered from 0 in the order the partition yields them; row i goes out
under publisher id `spark-<write id>[-b<batch>]-p<partition>-c<i // rowsPerPublisher>`
with sequence `i % rowsPerPublisher + 1`. A retried task, a speculative copy, or a
micro-batch Spark replays after a restart computes the same ids and sequences for the
same rows, and the master answers a repeat with the original offset (`duplicate=True`)
instead of storing it again.

* Batch writes: the write id is `writeId` if given, else a random id fixed on the driver
  when the write starts (shared by every attempt of every task of that write).
* Streaming writes: the write id is the query id (kept in the checkpoint, so the same
  across restarts), or `writeId`; the micro-batch id is Spark's.

What this needs, and where it stops (see docs/spark.md): a partition must hold the same
rows in the same order on every attempt (true for deterministic plans; not for, e.g., a
`repartition()` without a sort over non-deterministic input), and a retry must come while
the replica still remembers the sequences: rowsPerPublisher is kept at or below the
replica's `dedupe_window` (default 100,000) so every sequence of an id is remembered;
a retry older than the window is refused (FAILED_PRECONDITION), never stored twice.

Commit and abort: rows are visible to subscribers as soon as their task publishes them;
Squall has no transactions, so `abort` cannot withdraw rows that successful tasks stored.
It logs what was stored; re-running the write with the same `writeId` (batch) or letting
the query restart from its checkpoint (streaming) completes it without duplicates.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, MapType, StringType, StructType

from squall.spark._options import WriteOptions, publisher_id
from squall.spark._topic import SquallSparkError, connected, retrieve, topic_info

log = logging.getLogger("squall.spark")

# Spark's local properties that name the running micro-batch and its query, set for every
# task of a streaming query (the query id is stored in the checkpoint).
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"

_STRINGISH = (BinaryType(), StringType())
_HEADERS = MapType(StringType(), StringType())


def check_input(schema: StructType) -> None:
    """Refuses a DataFrame the sink cannot publish: it needs payload, may have key, headers."""
    names = schema.fieldNames()
    if "payload" not in names:
        raise ValueError(
            "the DataFrame written to squall needs a 'payload' column (binary or string); "
            f"it has {', '.join(names) or 'no columns'}"
        )
    for field in schema.fields:
        if field.name in ("payload", "key"):
            if field.dataType not in _STRINGISH:
                raise ValueError(
                    f"column {field.name!r} must be binary or string, not "
                    f"{field.dataType.simpleString()} (cast it, e.g. to_json(...) or "
                    "cast('string'))"
                )
        elif field.name == "headers":
            if field.dataType != _HEADERS:
                raise ValueError(
                    "column 'headers' must be map<string,string>, not "
                    f"{field.dataType.simpleString()}"
                )
        else:
            raise ValueError(
                f"the squall sink publishes the columns key, payload and headers; column "
                f"{field.name!r} is not one of them (select or drop it before writing)"
            )


class WriteSummary(WriterCommitMessage):
    """What one task stored: rows seen, new events, duplicates, the offsets they landed at."""

    def __init__(
        self,
        partition: int,
        attempt: int,
        rows: int,
        duplicates: int,
        first_offset: int | None,
        last_offset: int | None,
        publishers: int,
    ) -> None:
        self.partition = partition
        self.attempt = attempt
        self.rows = rows
        self.duplicates = duplicates
        self.first_offset = first_offset
        self.last_offset = last_offset
        self.publishers = publishers

    def __repr__(self) -> str:
        return (
            f"WriteSummary(partition={self.partition}, attempt={self.attempt}, rows={self.rows}, "
            f"duplicates={self.duplicates}, offsets={self.first_offset}..{self.last_offset})"
        )


def _text(value: Any) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def events(batches: Iterable[pa.RecordBatch], partition: int) -> Iterator[tuple[Any, ...]]:
    """The partition's rows as (key, payload) or (key, payload, headers), in order."""
    index = 0
    for batch in batches:
        names = batch.schema.names
        payloads = [_text(v) for v in batch.column(names.index("payload")).to_pylist()]
        keys = (
            [_text(v) for v in batch.column(names.index("key")).to_pylist()]
            if "key" in names
            else itertools.repeat(None, len(payloads))
        )
        for i, payload in enumerate(payloads):
            if payload is None:
                raise ValueError(
                    f"row {index + i} of partition {partition} has a null payload; Squall "
                    "events need one (filter nulls or coalesce(payload, ...) first)"
                )
        if "headers" in names:
            headers = [
                dict(h) if h is not None else None
                for h in batch.column(names.index("headers")).to_pylist()
            ]
            yield from zip(keys, payloads, headers, strict=False)
        else:
            yield from zip(keys, payloads, strict=False)
        index += len(payloads)


def publish_partition(
    options: WriteOptions,
    write_id: str,
    batch_id: int | None,
    batches: Iterable[pa.RecordBatch],
) -> WriteSummary:
    """Runs on an executor: publishes this task's rows with stable ids and sequences."""
    context = TaskContext.get()
    partition = context.partitionId() if context is not None else 0
    attempt = context.attemptNumber() if context is not None else 0
    common = options.common
    rows = duplicates = publishers = 0
    first: int | None = None
    last: int | None = None
    source = events(batches, partition)
    with connected(common) as client:
        topic = retrieve(client, common)
        # Bounded by the partition: each pass publishes one chunk of rowsPerPublisher rows.
        for chunk in itertools.count():
            head = next(source, None)
            if head is None:
                break
            rows_in_chunk = itertools.chain(
                [head], itertools.islice(source, options.rows_per_publisher - 1)
            )
            pid = publisher_id(write_id, batch_id, partition, chunk)
            with topic.publisher(pid, start_sequence=1) as publisher:
                receipts = publisher.publish_many(rows_in_chunk, options.batch_events)
            publishers += 1
            rows += len(receipts)
            for receipt in receipts:
                if receipt.duplicate:
                    duplicates += 1
                first = receipt.offset if first is None else min(first, receipt.offset)
                last = receipt.offset if last is None else max(last, receipt.offset)
    if duplicates:
        log.info(
            "squall write %s partition %d attempt %d: %d of %d rows were already stored "
            "(a retry or replay), not stored again",
            write_id,
            partition,
            attempt,
            duplicates,
            rows,
        )
    return WriteSummary(partition, attempt, rows, duplicates, first, last, publishers)


def _summarize(messages: list[WriterCommitMessage | None]) -> tuple[int, int, int]:
    summaries = [m for m in messages if isinstance(m, WriteSummary)]
    rows = sum(s.rows for s in summaries)
    duplicates = sum(s.duplicates for s in summaries)
    return rows, duplicates, len(messages) - len(summaries)


class SquallWriter(DataSourceArrowWriter):
    """A batch write (`df.write.format("squall")`): append-only, retries deduplicated."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        check_input(schema)
        topic_info(options.common, readable=False)
        self._options = options
        # Fixed here, on the driver, so every task attempt of this write shares it.
        self.write_id = options.write_id or uuid.uuid4().hex
        self._explicit_id = options.write_id is not None

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteSummary:
        """Runs on an executor: publishes one partition."""
        return publish_partition(self._options, self.write_id, None, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every task succeeded: the rows are stored (each once)."""
        rows, duplicates, _ = _summarize(messages)
        log.info(
            "squall write %s to %s committed: %d rows (%d were retries already stored)",
            self.write_id,
            self._options.common.topic,
            rows,
            duplicates,
        )
        if duplicates and self._explicit_id:
            # Indistinguishable from a retry: a re-used writeId with new data drops it.
            log.warning(
                "squall write %s: %d of %d rows were already stored under this writeId and "
                "were not stored again; if they are new data, write them with a new writeId",
                self.write_id,
                duplicates,
                rows,
            )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """A task failed for good: what succeeded stays stored; say how to finish the write."""
        rows, _, failed = _summarize(messages)
        advice = (
            "re-run it with the same writeId to store the rest without duplicates"
            if self._explicit_id
            else "set option writeId to make a re-run of the same input store nothing twice"
        )
        log.warning(
            "squall write %s to %s aborted: %d partitions failed; %d rows of the partitions "
            "that succeeded are stored and stay (Squall has no transactions); %s",
            self.write_id,
            self._options.common.topic,
            failed,
            rows,
            advice,
        )


class SquallStreamWriter(DataSourceStreamArrowWriter):
    """A streaming sink: exactly once per (query, micro-batch, partition, row)."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        check_input(schema)
        topic_info(options.common, readable=False)
        self._options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteSummary:
        """Runs on an executor: publishes one partition of one micro-batch."""
        context = TaskContext.get()
        batch = context.getLocalProperty(BATCH_ID_PROPERTY) if context is not None else None
        query = context.getLocalProperty(QUERY_ID_PROPERTY) if context is not None else None
        if batch is None or not batch.isdigit() or (query is None and not self._options.write_id):
            raise SquallSparkError(
                "the squall stream writer runs outside a streaming micro-batch (Spark set no "
                f"{BATCH_ID_PROPERTY!r}); use df.write for batch writes"
            )
        write_id = self._options.write_id or str(query)
        return publish_partition(self._options, write_id, int(batch), iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """The micro-batch's rows are stored (each once)."""
        rows, duplicates, _ = _summarize(messages)
        log.info(
            "squall stream to %s: micro-batch %d committed, %d rows (%d already stored)",
            self._options.common.topic,
            batchId,
            rows,
            duplicates,
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """A task failed for good; a restart replays the micro-batch, storing nothing twice."""
        rows, _, failed = _summarize(messages)
        log.warning(
            "squall stream to %s: micro-batch %d aborted (%d partitions failed, %d rows of the "
            "others stored); restarting the query from its checkpoint replays it without "
            "duplicates",
            self._options.common.topic,
            batchId,
            failed,
            rows,
        )
