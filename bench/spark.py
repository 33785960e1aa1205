"""The PySpark data source's throughput: batch read and write through Spark local[2].

Three nodes from deploy/cluster.example.toml with its default settings (master SYNC,
replicas WRITE_NO_SYNC, majority acks), run as real processes on loopback, and one Spark
session in local[2] mode (two task slots, the JVM with its full JIT) in this process.
100-byte payloads with a short key.

* read: `spark.read.format("squall")` of the whole topic, in `partitions` offset ranges,
  into Spark's `noop` sink (every row and column is produced, nothing is kept); rows/s
  is the topic's events over the action's wall time.
* write: a DataFrame of `events` rows in `partitions` partitions (built by Spark from
  `range`, so producing it costs next to nothing) written with
  `df.write.format("squall")`; rows/s is rows over the action's wall time, each row
  acknowledged by a majority before the task ends. Each repeat uses a new writeId, so
  every repeat stores its rows (no deduplication hits).

A warm-up read and write (not timed) starts the Python workers first. The client side
(the JVM, the Python workers and the executor-side Squall clients) and the three nodes
share the machine's cores. Every action is bounded by the data it has; the whole run is
bounded by Spark's own task failure handling (one attempt) and the cluster's timeouts.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import squall
from bench import replicated, single_node

SOURCE_TOPIC = "bench-spark-read"
SINK_TOPIC = "bench-spark-write"
WARMUP_EVENTS = 2_000


@dataclass(frozen=True)
class Sizes:
    """Rows per action, Spark partitions, and repeats."""

    events: int
    partitions: int
    repeats: int

    @classmethod
    def full(cls) -> Sizes:
        """The full run: a few minutes on a busy 2-core machine."""
        return cls(events=200_000, partitions=4, repeats=3)

    @classmethod
    def quick(cls) -> Sizes:
        """A smoke run."""
        return cls(events=20_000, partitions=2, repeats=1)


def _rate(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0


def _summary(samples: list[float]) -> dict[str, Any]:
    return {
        "rows_per_s": round(statistics.median(samples), 1),
        "rows_per_s_min": min(samples),
        "rows_per_s_max": max(samples),
        "samples": samples,
    }


def run(sizes: Sizes, temp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Starts three nodes and a Spark session; times batch reads and writes."""
    from squall.spark import local_session

    results: dict[str, Any] = {
        "template": "deploy/cluster.example.toml (defaults: SYNC/WRITE_NO_SYNC/majority)",
        "spark_master": "local[2]",
        "event_bytes": single_node.EVENT_BYTES,
        "sizes": vars(sizes),
    }
    with replicated.running(temp) as cluster:
        gateway = cluster.gateway_address
        with squall.connect(gateway) as client:
            for name in (SOURCE_TOPIC, SINK_TOPIC):
                client.create_topic(name)
            log(f"bench: spark, filling {SOURCE_TOPIC} with {sizes.events} events")
            payloads = single_node.payloads(sizes.events)
            with client.topic(SOURCE_TOPIC).publisher() as publisher:
                publisher.publish_many(
                    ((b"k%d" % (i % 64), p) for i, p in enumerate(payloads)), batch_events=500
                )
        log("bench: spark, starting the Spark session (local[2])")
        started = time.monotonic()
        spark = local_session("squall-bench", cores=2, quick_jvm=False)
        results["session_start_s"] = round(time.monotonic() - started, 1)
        try:
            per_split = -(-sizes.events // sizes.partitions)
            filler = "x" * (single_node.EVENT_BYTES - 12)

            def read_all(end: int | None = None) -> None:
                reader = (
                    spark.read.format("squall")
                    .option("gateway", gateway)
                    .option("topic", SOURCE_TOPIC)
                    .option("maxEventsPerSplit", per_split if end is None else end)
                )
                if end is not None:
                    reader = reader.option("endingOffsets", end)
                reader.load().write.format("noop").mode("overwrite").save()

            def write(rows: int, write_id: str) -> None:
                (
                    spark.range(0, rows, 1, sizes.partitions)
                    .selectExpr(
                        "cast(id % 64 as string) as key",
                        f"concat(lpad(cast(id as string), 12, '0'), '{filler}') as payload",
                    )
                    .write.format("squall")
                    .option("gateway", gateway)
                    .option("topic", SINK_TOPIC)
                    .option("writeId", write_id)
                    .mode("append")
                    .save()
                )

            log("bench: spark, warm-up read and write")
            read_all(WARMUP_EVENTS)
            write(WARMUP_EVENTS, f"warmup-{uuid.uuid4().hex[:8]}")
            reads: list[float] = []
            writes: list[float] = []
            for repeat in range(sizes.repeats):
                log(f"bench: spark, read {repeat + 1}/{sizes.repeats} ({sizes.events} rows)")
                started = time.monotonic()
                read_all()
                reads.append(_rate(sizes.events, time.monotonic() - started))
                log(f"bench: spark, write {repeat + 1}/{sizes.repeats} ({sizes.events} rows)")
                started = time.monotonic()
                write(sizes.events, f"bench-{uuid.uuid4().hex[:12]}")
                writes.append(_rate(sizes.events, time.monotonic() - started))
            results["read"] = _summary(reads)
            results["write"] = _summary(writes)
        finally:
            spark.stop()
        with squall.connect(gateway) as client:
            stored = client.topic(SINK_TOPIC).info.next_offset
        expected = WARMUP_EVENTS + sizes.events * sizes.repeats
        if stored != expected:
            raise RuntimeError(f"the writes stored {stored} events, not {expected}")
    return results


def table(results: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    sizes = results["sizes"]
    lines = [
        f"| Spark local[2], 3 nodes, {results['event_bytes']}-byte payloads, "
        f"{sizes['events']} rows in {sizes['partitions']} partitions "
        "| rows/s (median) | min | max |",
        "|---|---:|---:|---:|",
    ]
    for label, key in (("batch read (into noop)", "read"), ("batch write", "write")):
        figures = results[key]
        lines.append(
            f"| {label} | {figures['rows_per_s']:,.0f} | {figures['rows_per_s_min']:,.0f} "
            f"| {figures['rows_per_s_max']:,.0f} |"
        )
    return "\n".join(lines)
