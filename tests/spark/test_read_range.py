"""One offset range read the way a Spark task reads it, without a SparkSession.

Goal: a task returns exactly its range, and a range planned beyond what the cluster will
ever serve (a failover discarded uncommitted events) fails with a sentence after
timeoutMs instead of hanging the Spark job.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

pytest.importorskip(
    "pyspark", reason="the spark extra is not installed (pip install -e './clients[spark]')"
)

import squall
from squall.spark import SCHEMA, OffsetRange, SquallSparkError
from squall.spark._options import parse_read
from squall.spark._reader import SquallReader, read_range
from tests.integration.conftest import LocalCluster


def test_a_range_reads_exactly_its_offsets(
    spark_cluster: LocalCluster, new_topic: Callable[[], str]
) -> None:
    topic = new_topic()
    with squall.connect(spark_cluster.gateway_address) as client:
        with client.topic(topic).publisher() as publisher:
            publisher.publish_many(b"e%d" % i for i in range(30))
    options = parse_read(
        {"gateway": spark_cluster.gateway_address, "topic": topic}, streaming=False
    )
    batches = list(read_range(options, SCHEMA, OffsetRange(7, 19)))
    offsets = [o for b in batches for o in b.column("offset").to_pylist()]
    payloads = [p for b in batches for p in b.column("payload").to_pylist()]
    assert offsets == list(range(7, 19))
    assert payloads == [b"e%d" % i for i in range(7, 19)]


def test_a_range_past_what_the_cluster_serves_fails_after_the_timeout(
    spark_cluster: LocalCluster, new_topic: Callable[[], str]
) -> None:
    topic = new_topic()
    with squall.connect(spark_cluster.gateway_address) as client:
        with client.topic(topic).publisher() as publisher:
            publisher.publish_many(b"e%d" % i for i in range(5))
    options = parse_read(
        {"gateway": spark_cluster.gateway_address, "topic": topic, "timeoutMs": "500"},
        streaming=False,
    )
    with pytest.raises(SquallSparkError, match="no event at offset 5 within 500 ms"):
        list(read_range(options, SCHEMA, OffsetRange(0, 8)))


def test_a_time_range_reads_the_events_published_within_it(
    spark_cluster: LocalCluster, new_topic: Callable[[], str]
) -> None:
    topic = new_topic()
    batches = 3
    with squall.connect(spark_cluster.gateway_address) as client:
        with client.topic(topic).publisher() as publisher:
            for batch in range(batches):
                publisher.publish_many(b"b%d-%d" % (batch, i) for i in range(10))
                publisher.flush()
                time.sleep(0.01)  # the next batch is stamped at a later millisecond
        stamps = [m.timestamp_ms for m in client.topic(topic).subscribe(follow=False, dedupe=False)]
    # Each batch's events are stamped before the next batch's (the master's clock).
    assert max(stamps[:10]) < min(stamps[10:20]) and max(stamps[10:20]) < min(stamps[20:])
    gateway = spark_cluster.gateway_address

    def offsets(**times: int) -> list[int]:
        options = {"gateway": gateway, "topic": topic, "maxEventsPerSplit": "4"}
        options |= {name: str(ms) for name, ms in times.items()}
        reader = SquallReader(parse_read(options, streaming=False), SCHEMA)
        return [
            offset
            for partition in reader.partitions()
            for batch in reader.read(partition)
            for offset in batch.column("offset").to_pylist()
        ]

    # [the second batch's first stamp, the third's): exactly the second batch.
    assert offsets(startingTimestamp=stamps[10], endingTimestamp=stamps[20]) == list(range(10, 20))
    # Before the first event: from the first; an end in the future: to the topic's end.
    future = stamps[-1] + 3_600_000
    assert offsets(startingTimestamp=0, endingTimestamp=future) == list(range(30))
    assert offsets(startingTimestamp=stamps[20]) == list(range(20, 30))
    # A start in the future of the master's clock is refused, naming the option.
    with pytest.raises(ValueError, match=r"option 'startingTimestamp'.*future"):
        offsets(startingTimestamp=future)
