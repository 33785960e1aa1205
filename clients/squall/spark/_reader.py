"""Reading a topic into Spark: the batch reader, the streaming reader, and one range's read.

A read is planned on the driver as offset ranges (`OffsetRange`, at most
`maxEventsPerSplit` events each) and each range is read by one task on an executor, which
opens its own client and subscribes from the range's start to its end. The server holds
events back until they are committed, so a range planned up to the topic's end is read
in full once its events commit; a gap in the offsets (events that should be there and
are not) fails the task rather than returning a DataFrame with rows missing.

Both readers are pickled by Spark before `partitions()` runs and again for the tasks, so
every decision `read()` needs is made in `__init__` (the resolved range) or carried by the
partition; the streaming reader's driver-side client is dropped when it is pickled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

import squall
from squall.spark._options import (
    ReadOptions,
    admit,
    offset_from_json,
    offset_to_json,
    resolve,
    split,
)
from squall.spark._topic import (
    SquallSparkError,
    connected,
    offset_at_time,
    retrieve,
    topic_info,
)

log = logging.getLogger("squall.spark")

# What the server sends per response; the reader turns a few responses into one Arrow batch.
SUBSCRIBE_BATCH_EVENTS = 5_000
ARROW_BATCH_ROWS = 10_000

# The DataFrame's columns, in order (see docs/spark.md for what each holds).
SCHEMA_DDL = (
    "topic string, offset long, key binary, payload binary, timestamp timestamp, "
    "publisher_id string, sequence long, session_token string, headers map<string,string>"
)
# Built by hand: parsing DDL needs a running SparkContext, and this module is imported
# before one exists (and in workers that never have one).
SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("offset", LongType()),
        StructField("key", BinaryType()),
        StructField("payload", BinaryType()),
        StructField("timestamp", TimestampType()),
        StructField("publisher_id", StringType()),
        StructField("sequence", LongType()),
        StructField("session_token", StringType()),
        StructField("headers", MapType(StringType(), StringType())),
    ]
)
COLUMNS = tuple(SCHEMA.fieldNames())


def _column(message: squall.Message, name: str) -> Any:
    if name == "timestamp":
        return message.timestamp_ms * 1000  # Arrow timestamp[us]
    if name == "headers":
        return list(message.headers.items())
    return getattr(message, name)


def check_columns(schema: StructType) -> None:
    """Refuses a user-given schema that asks for a column the source does not have."""
    ours = {field.name: field.dataType for field in SCHEMA.fields}
    for field in schema.fields:
        if field.name not in ours:
            raise ValueError(
                f"the squall source has no column {field.name!r}; its columns are "
                f"{', '.join(COLUMNS)} (leave out .schema() to get them all)"
            )
        if field.dataType != ours[field.name]:
            raise ValueError(
                f"column {field.name!r} is {ours[field.name].simpleString()} in the squall "
                f"source, not {field.dataType.simpleString()}"
            )


class OffsetRange(InputPartition):
    """Offsets [start, end) of the topic, read by one Spark task."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end


def _record_batch(
    messages: Sequence[squall.Message], names: Sequence[str], arrow: Any
) -> pa.RecordBatch:
    arrays = [
        pa.array([_column(m, name) for m in messages], type=arrow.field(name).type)
        for name in names
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow)


class _StallGuard:
    """Closes a subscription that waits longer than timeout_s for the server's next batch.

    A range is planned up to the topic's next offset, which may include events not yet
    committed; if a failover discards them and nothing new arrives, the stream would wait
    for ever. Only time spent waiting on the server counts (paused while Spark consumes).
    """

    def __init__(self, subscription: squall.Subscription, timeout_s: float) -> None:
        self._subscription = subscription
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._since: float | None = time.monotonic()
        self._done = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="squall-read-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        # Bounded by the read: stop() ends it, and so does firing.
        while not self._done.wait(min(1.0, self._timeout_s / 4)):
            with self._lock:
                stalled = (
                    self._since is not None and time.monotonic() - self._since > self._timeout_s
                )
                if stalled:
                    self.fired = True
            if stalled:
                self._subscription.close()
                return

    def pause(self) -> None:
        """The reader hands rows to Spark: not waiting on the server."""
        with self._lock:
            self._since = None

    def resume(self) -> None:
        """The reader waits on the server again."""
        with self._lock:
            self._since = time.monotonic()

    def stop(self) -> None:
        """Ends the watch."""
        self._done.set()
        self._thread.join()


def read_range(
    options: ReadOptions, schema: StructType, partition: InputPartition
) -> Iterator[pa.RecordBatch]:
    """Every event in the partition's range, in offset order, as Arrow record batches.

    Fails (rather than return fewer rows) if an offset in the range is missing, or if the
    server sends nothing for timeoutMs while events of the range are still to come.
    """
    if not isinstance(partition, OffsetRange) or partition.start >= partition.end:
        return  # Spark plans one partition of None for an empty read
    common = options.common
    # The timezone Spark's own conversion uses for Python data sources.
    arrow = to_arrow_schema(schema, timezone="UTC")
    names = schema.fieldNames()
    expected = partition.start
    pending: list[squall.Message] = []
    with connected(common) as client:
        topic = retrieve(client, common)
        # follow=True with an end: the server waits for events in the range to commit and
        # ends the stream at the end; the library reconnects on failover.
        with topic.subscribe(
            start=partition.start,
            follow=True,
            max_batch_events=SUBSCRIBE_BATCH_EVENTS,
            end_offset=partition.end,
        ) as subscription:
            guard = _StallGuard(subscription, common.timeout_s)
            try:
                for batch in subscription.batches():
                    guard.resume()
                    for message in batch:
                        if message.offset != expected:
                            raise SquallSparkError(
                                f"topic {common.topic!r}: expected offset {expected}, got "
                                f"{message.offset} (events {expected}..{message.offset - 1} "
                                "are missing; was the topic destroyed and re-created?)"
                            )
                        expected += 1
                    pending.extend(batch)
                    if len(pending) >= ARROW_BATCH_ROWS:
                        guard.pause()
                        yield _record_batch(pending, names, arrow)
                        guard.resume()
                        pending = []
                    if expected >= partition.end:
                        break
            finally:
                guard.stop()
    if guard.fired and expected != partition.end:
        raise SquallSparkError(
            f"topic {common.topic!r}: no event at offset {expected} within "
            f"{common.timeout_ms} ms (option 'timeoutMs'), though the read was planned up to "
            f"{partition.end}: a failover may have discarded events that were not yet "
            "committed; run the query again"
        )
    if pending:
        yield _record_batch(pending, names, arrow)
    if expected != partition.end:
        raise SquallSparkError(
            f"topic {common.topic!r}: the read of offsets {partition.start}..{partition.end - 1} "
            f"ended at {expected} (was the topic destroyed?)"
        )


def _start(options: ReadOptions, info: squall.TopicInfo) -> int:
    """The first offset to read: startingTimestamp's, else startingOffsets'."""
    if options.starting_timestamp_ms is not None:
        return offset_at_time(
            options.common, info, options.starting_timestamp_ms, "startingTimestamp", ending=False
        )
    return resolve(options.starting, info.first_offset, info.next_offset, "startingOffsets")


class SquallReader(DataSourceReader):
    """A batch read: the topic's range fixed when the query is planned, split by offsets."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        check_columns(schema)
        self._options = options
        self._schema = schema
        info = topic_info(options.common, readable=True)
        start = _start(options, info)
        if options.ending_timestamp_ms is not None:
            end = offset_at_time(
                options.common, info, options.ending_timestamp_ms, "endingTimestamp", ending=True
            )
        else:
            end = resolve(options.ending, info.first_offset, info.next_offset, "endingOffsets")
        if end < start:
            raise ValueError(
                f"option 'endingOffsets' resolves to {end}, below 'startingOffsets' ({start})"
            )
        # Resolved here, not in partitions(): Spark pickles the reader before that runs.
        self._ranges = split(start, end, options.max_events_per_split)
        log.info(
            "squall read of %s: offsets %d..%d in %d partitions",
            options.common.topic,
            start,
            end,
            len(self._ranges),
        )

    def partitions(self) -> list[InputPartition]:
        """One partition per offset range."""
        return [OffsetRange(lo, hi) for lo, hi in self._ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Runs on an executor: the range's events."""
        return read_range(self._options, self._schema, partition)


class SquallStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A Structured Streaming source: JSON offsets, maxEventsPerTrigger, availableNow."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        check_columns(schema)
        self._options = options
        self._schema = schema
        info = topic_info(options.common, readable=True)
        # Used only by a query without a checkpoint; a restarted query resumes from it.
        self._initial = _start(options, info)
        self._target: int | None = None
        self._client: squall.Client | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None  # a channel cannot be pickled; executors open their own
        return state

    def _next_offset(self) -> int:
        """The topic's end now (the driver keeps one client for the query's life)."""
        common = self._options.common
        if self._client is None:
            self._client = squall.connect(
                common.gateway, timeout_s=common.timeout_s, tls=common.tls
            )
        try:
            info = retrieve(self._client, common).info
        except BaseException:
            self._client.close()
            self._client = None
            raise
        return info.next_offset

    def _offset(self, document: dict[str, Any], what: str) -> int:
        return offset_from_json(document, self._options.common.topic, what=what)

    def initialOffset(self) -> dict[str, Any]:
        """Where a query without a checkpoint starts (startingOffsets, default latest)."""
        return offset_to_json(self._options.common.topic, self._initial)

    def getDefaultReadLimit(self) -> ReadLimit:
        """maxEventsPerTrigger as Spark's ReadMaxRows, or no limit."""
        per_trigger = self._options.max_events_per_trigger
        return ReadAllAvailable() if per_trigger is None else ReadMaxRows(per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fixes the end this availableNow run stops at: the topic's end now."""
        self._target = self._next_offset()
        log.info(
            "squall stream of %s: availableNow stops at offset %d",
            self._options.common.topic,
            self._target,
        )

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The next micro-batch's end: the topic's end, bounded by the limit and target."""
        begin = self._offset(start, "the stream's start offset")
        available = self._next_offset()
        if begin > available:
            raise SquallSparkError(
                f"topic {self._options.common.topic!r} ends at offset {available}, before this "
                f"query's checkpointed offset {begin}: was it destroyed and re-created? "
                "(start the query with a new checkpointLocation)"
            )
        if isinstance(limit, ReadMinRows) and available - begin < limit.min_rows:
            return offset_to_json(self._options.common.topic, begin)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = admit(begin, available, max_rows, self._target)
        return offset_to_json(self._options.common.topic, end)

    def reportLatestOffset(self) -> dict[str, Any]:
        """The topic's end, for the query's progress report."""
        return offset_to_json(self._options.common.topic, self._next_offset())

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        """The micro-batch's offsets cut into ranges of at most maxEventsPerSplit."""
        lo = self._offset(start, "the micro-batch's start offset")
        hi = self._offset(end, "the micro-batch's end offset")
        return [OffsetRange(a, b) for a, b in split(lo, hi, self._options.max_events_per_split)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Runs on an executor: the range's events."""
        return read_range(self._options, self._schema, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the topic keeps its events, the checkpoint keeps the offset."""

    def stop(self) -> None:
        """Closes the driver's client."""
        if self._client is not None:
            self._client.close()
            self._client = None
