"""The squall format in a real SparkSession against a real local Squall cluster.

Goal: what a data team relies on — a batch read returns exactly what was published, a
stream resumes from its checkpoint without reading anything twice, a write whose task
dies and is retried (or whose micro-batch is replayed) stores each row once, and bad
options fail at load()/save()/start() with a sentence naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import squall
from deploy import processes
from tests.integration.conftest import LocalCluster
from tests.spark import flaky

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark

QUERY_TIMEOUT_S = 240


def _publish(gateway: str, topic: str, count: int, first: int = 0) -> list[squall.Receipt]:
    with squall.connect(gateway) as client, client.topic(topic).publisher() as publisher:
        return publisher.publish_many(
            (b"key-%d" % (i % 4), b"event-%d" % i, {"n": str(i)})
            for i in range(first, first + count)
        )


def _messages(gateway: str, topic: str) -> list[squall.Message]:
    with squall.connect(gateway) as client, client.topic(topic).subscribe(follow=False) as sub:
        return list(sub)


def _reader(spark: SparkSession, gateway: str, topic: str, **options: Any) -> Any:
    reader = spark.read.format("squall").option("gateway", gateway).option("topic", topic)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader


def _run_available_now(stream: DataFrame, sink: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """Runs a query with trigger(availableNow) to its end; its progress reports."""
    query = sink(stream.writeStream.trigger(availableNow=True)).start()
    try:
        finished = query.awaitTermination(QUERY_TIMEOUT_S)
        assert finished, f"query still running after {QUERY_TIMEOUT_S} s"
        assert query.exception() is None, query.exception()
        return [p for p in query.recentProgress if p["numInputRows"] > 0]
    finally:
        query.stop()


def test_batch_read_equals_what_was_published(
    spark: SparkSession, spark_cluster: LocalCluster, new_topic: Callable[[], str]
) -> None:
    gateway = spark_cluster.gateway_address
    topic = new_topic()
    _publish(gateway, topic, 57)
    published = _messages(gateway, topic)

    df = _reader(spark, gateway, topic, maxEventsPerSplit=10).load()
    assert df.rdd.getNumPartitions() == 6
    rows = sorted(df.collect(), key=lambda r: r.offset)
    assert [r.offset for r in rows] == list(range(57))
    for row, message in zip(rows, published, strict=True):
        assert row.topic == topic
        assert (row.key, row.payload) == (message.key, message.payload)
        assert (row.publisher_id, row.sequence) == (message.publisher_id, message.sequence)
        assert row.session_token == message.session_token
        assert row.headers == dict(message.headers)
        assert round(row.timestamp.timestamp() * 1000) == message.timestamp_ms

    ending = json.dumps({"topic": topic, "offset": 40})
    ranged = _reader(
        spark, gateway, topic, startingOffsets="12", endingOffsets=ending, maxEventsPerSplit=7
    ).load()
    assert ranged.rdd.getNumPartitions() == 4
    assert sorted(r.offset for r in ranged.select("offset").collect()) == list(range(12, 40))
    # A subset of the columns, as a user-given schema.
    payloads = _reader(spark, gateway, topic).schema("offset long, payload binary").load()
    assert payloads.orderBy("offset").first().payload == b"event-0"


def test_stream_resumes_from_its_checkpoint_without_rereading(
    spark: SparkSession,
    spark_cluster: LocalCluster,
    new_topic: Callable[[], str],
    tmp_path: Path,
) -> None:
    gateway = spark_cluster.gateway_address
    source, target = new_topic(), new_topic()
    _publish(gateway, source, 30)
    checkpoint = tmp_path / "checkpoint"

    def run() -> list[dict[str, Any]]:
        stream = (
            spark.readStream.format("squall")
            .option("gateway", gateway)
            .option("subscribe", source)  # Kafka's names: subscribe, maxOffsetsPerTrigger
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", 10)
            .load()
            .selectExpr("key", "payload", "headers")
        )
        return _run_available_now(
            stream,
            lambda w: (
                w.format("squall")
                .option("gateway", gateway)
                .option("topic", target)
                .option("checkpointLocation", str(checkpoint))
            ),
        )

    first = run()
    # Admission control: maxOffsetsPerTrigger (maxEventsPerTrigger) cuts the 30 events into
    # three micro-batches.
    assert [p["numInputRows"] for p in first] == [10, 10, 10]
    assert json.loads(first[-1]["sources"][0]["endOffset"]) == {"topic": source, "offset": 30}

    _publish(gateway, source, 15, first=30)
    second = run()
    # Only the new events are read: the restart resumes at the checkpointed offset 30.
    assert [p["numInputRows"] for p in second] == [10, 5]
    assert json.loads(second[0]["sources"][0]["startOffset"]) == {"topic": source, "offset": 30}

    copied = _messages(gateway, target)
    assert [m.payload for m in copied] == [b"event-%d" % i for i in range(45)]
    assert [m.key for m in copied] == [b"key-%d" % (i % 4) for i in range(45)]
    assert copied[7].headers == {"n": "7"}


def test_replayed_micro_batch_is_not_stored_twice(
    spark: SparkSession,
    spark_cluster: LocalCluster,
    new_topic: Callable[[], str],
    tmp_path: Path,
) -> None:
    gateway = spark_cluster.gateway_address
    source, target = new_topic(), new_topic()
    _publish(gateway, source, 20)
    checkpoint = tmp_path / "checkpoint"

    def run() -> list[dict[str, Any]]:
        stream = (
            spark.readStream.format("squall")
            .option("gateway", gateway)
            .option("topic", source)
            .option("startingOffsets", "earliest")
            .option("maxEventsPerTrigger", 12)
            .load()
            .selectExpr("key", "payload")
        )
        return _run_available_now(
            stream,
            lambda w: (
                w.format("squall")
                .option("gateway", gateway)
                .option("topic", target)
                .option("checkpointLocation", str(checkpoint))
            ),
        )

    assert [p["batchId"] for p in run()] == [0, 1]
    assert len(_messages(gateway, target)) == 20
    # A crash after the sink wrote batch 1 but before Spark recorded it as committed:
    # the restarted query runs batch 1 again, with the same query id and batch id.
    (checkpoint / "commits" / "1").unlink()
    (checkpoint / "commits" / ".1.crc").unlink(missing_ok=True)
    replay = run()
    assert [(p["batchId"], p["numInputRows"]) for p in replay] == [(1, 8)]

    stored = _messages(gateway, target)
    assert [m.payload for m in stored] == [b"event-%d" % i for i in range(20)]
    # The replay's events carry the same publisher ids as the first run's: deduplicated.
    assert len({m.publisher_id for m in stored}) == 2


def test_write_with_a_failed_and_retried_task_stores_each_row_once(
    spark: SparkSession, spark_cluster: LocalCluster, new_topic: Callable[[], str]
) -> None:
    gateway = spark_cluster.gateway_address
    topic = new_topic()
    write_id = f"retry-{topic}"[:64]
    rows = [(f"k{i % 5}", f"row-{i}") for i in range(120)]
    # Two partitions straight from local data: no shuffle, so a retry sees the same rows
    # in the same order (what exactly-once needs; see docs/spark.md).
    df = spark.createDataFrame(rows, "key string, payload string")
    assert df.rdd.getNumPartitions() == 2
    expected = {payload for _, payload in rows}

    (
        df.write.format("squall_flaky")
        .option("gateway", gateway)
        .option("topic", topic)
        .option("writeId", write_id)
        .option("batchEvents", 5)
        .option("rowsPerPublisher", 7)
        .mode("append")
        .save()
    )

    # The first attempt of partition 0 published rows, then died; Spark retried it.
    failed_after = flaky.rows_before_failure(write_id)
    assert failed_after == flaky.FAIL_AFTER_ROWS
    stored = _messages(gateway, topic)
    payloads = [m.payload.decode() for m in stored]
    assert sorted(payloads) == sorted(expected), "a row is missing or stored twice"
    # Every row went out under this write's ids: chunks of rowsPerPublisher, sequences 1..7.
    assert all(m.publisher_id.startswith(f"spark-{write_id}-p") for m in stored)
    assert {m.sequence for m in stored} == set(range(1, 8))

    # Re-running the whole write with the same writeId stores nothing more.
    df.write.format("squall").option("gateway", gateway).option("topic", topic).option(
        "writeId", write_id
    ).option("rowsPerPublisher", 7).mode("append").save()
    assert len(_messages(gateway, topic)) == len(rows)


def test_a_fixed_write_id_stores_its_rows_again_in_a_recreated_topic(
    spark: SparkSession, spark_cluster: LocalCluster, new_topic: Callable[[], str]
) -> None:
    """Issue 14: a job re-run with its writeId after the topic was destroyed and created
    again stores every row (the old incarnation's dedupe state is gone with it)."""
    gateway = spark_cluster.gateway_address
    topic = new_topic()
    write_id = f"again-{topic}"[:64]

    def write(prefix: str) -> None:
        rows = [(f"k{i % 3}", f"{prefix}-{i}") for i in range(20)]
        df = spark.createDataFrame(rows, "key string, payload string").coalesce(1)
        df.write.format("squall").option("gateway", gateway).option("topic", topic).option(
            "writeId", write_id
        ).mode("append").save()

    write("old")
    assert len(_messages(gateway, topic)) == 20
    with squall.connect(gateway) as client:
        client.destroy_topic(topic)
        client.create_topic(topic)
    write("new")
    stored = _messages(gateway, topic)
    assert sorted(m.payload.decode() for m in stored) == sorted(f"new-{i}" for i in range(20))
    assert [m.offset for m in stored] == list(range(20))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gateway": None}, "option 'gateway' is required"),
        ({"topic": "no-such-topic"}, "Squall topic 'no-such-topic' does not exist"),
        ({"startingOffsets": "soon"}, "option 'startingOffsets' must be 'earliest', 'latest'"),
        ({"endingOffsets": '{"offset": -1}'}, "offset must be an integer >= 0"),
        ({"maxEventsPerSplt": "10"}, "unknown squall option 'maxeventspersplt'"),
        ({"gateway": "127.0.0.1"}, "option 'gateway' must be host:port"),
        ({"gateway": "UNREACHABLE"}, "cannot reach the Squall gateway at 127.0.0.1:"),
    ],
)
def test_bad_read_options_fail_at_load_with_a_clear_message(
    spark: SparkSession,
    spark_cluster: LocalCluster,
    new_topic: Callable[[], str],
    options: dict[str, str | None],
    message: str,
) -> None:
    topic = new_topic()
    reader = spark.read.format("squall")
    for key, value in {"gateway": spark_cluster.gateway_address, "topic": topic, **options}.items():
        if value == "UNREACHABLE":
            value = f"127.0.0.1:{processes.free_port()}"  # nothing listens there
        if value is not None:
            reader = reader.option(key, value)
    with pytest.raises(Exception) as raised:
        reader.load()
    assert message in str(raised.value)


def test_bad_write_and_stream_options_fail_at_save_and_start(
    spark: SparkSession, spark_cluster: LocalCluster, new_topic: Callable[[], str], tmp_path: Path
) -> None:
    gateway = spark_cluster.gateway_address
    topic = new_topic()
    df = spark.createDataFrame([(1, "x")], "n int, payload string")

    with pytest.raises(Exception) as raised:
        df.write.format("squall").option("gateway", gateway).option("topic", topic).mode(
            "append"
        ).save()
    assert "column 'n' is not one of them" in str(raised.value)

    with pytest.raises(Exception) as raised:
        df.select("payload").write.format("squall").option("gateway", gateway).option(
            "topic", "missing-topic"
        ).mode("append").save()
    assert "Squall topic 'missing-topic' does not exist" in str(raised.value)

    stream = (
        spark.readStream.format("squall").option("gateway", gateway).option("topic", topic).load()
    )
    # Spark builds a Python streaming sink in the query's own thread, after start()
    # returns: the query stops before its first micro-batch, with the sentence.
    query = (
        stream.select("payload")
        .writeStream.format("squall")
        .option("gateway", gateway)
        .option("topic", "missing-topic")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    try:
        with pytest.raises(Exception) as raised:
            query.awaitTermination(QUERY_TIMEOUT_S)
        assert "Squall topic 'missing-topic' does not exist" in str(raised.value)
        assert query.lastProgress is None
    finally:
        query.stop()
    # Nothing was written anywhere by the refused writes.
    assert _messages(gateway, topic) == []
