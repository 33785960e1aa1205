"""One offset range read the way a Spark task reads it, without a SparkSession.

Goal: a task returns exactly its range, and a range planned beyond what the cluster will
ever serve (a failover discarded uncommitted events) fails with a sentence after
timeoutMs instead of hanging the Spark job.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip(
    "pyspark", reason="the spark extra is not installed (pip install -e './clients[spark]')"
)

import squall
from squall.spark import SCHEMA, OffsetRange, SquallSparkError
from squall.spark._options import parse_read
from squall.spark._reader import read_range
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
