"""A streaming pipeline on Spark: sensor readings in, per-sensor windowed statistics out.

    # the job, against a running cluster (make run), until Ctrl-C
    .venv/bin/python examples/spark_pipeline.py --gateway 127.0.0.1:7100

    # the demo (`make pipeline-demo`): uses the `make run` cluster if one is up, else
    # starts that same cluster (deploy/cluster.example.toml, data in .run/data) and
    # stops it by PID at the end
    .venv/bin/python examples/spark_pipeline.py --demo

The job reads the topic `sensor-readings` (JSON payloads {"sensor", "value",
"event_time_ms"}) as a Structured Streaming source, aggregates per sensor in 10-second
event-time windows with a 10-second watermark (readings may arrive late and out of
order), and writes each closed window once to two sinks: the Squall topic
`sensor-windows` (key = sensor, payload = JSON) and Parquet files. Both queries keep a
checkpoint, so a restarted job resumes where it stopped: nothing is read twice, and the
Squall sink's publisher ids (query id, micro-batch, partition) make a replayed
micro-batch store nothing twice.

The demo publishes simulated readings, runs both queries with trigger(availableNow)
(maxEventsPerTrigger splits the backlog into micro-batches, so the watermark moves and
windows close along the way), prints the windows read back with the batch reader, checks
them against a plain-Python computation from the raw readings, then publishes more
readings and runs again from the checkpoints to show the resume.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: deploy/ is not an installed package

import squall  # noqa: E402

SOURCE_TOPIC = "sensor-readings"
SINK_TOPIC = "sensor-windows"
WINDOW_S = 10
WATERMARK_S = 10
SENSORS = ("boiler", "chiller", "pump-a", "pump-b")
READINGS_PER_SECOND = 5  # per sensor
LATE_S_MAX = 3  # how late a reading may arrive (well inside the watermark)
READING_SCHEMA = "sensor string, value double, event_time_ms long"
QUERY_RESTARTS_MAX = 2


# --- the job ------------------------------------------------------------------------


def windowed(spark: Any, gateway: str, max_events_per_trigger: int) -> Any:
    """The streaming DataFrame of closed windows: one row per (window, sensor)."""
    from pyspark.sql import functions as F

    readings = (
        spark.readStream.format("squall")
        .option("gateway", gateway)
        .option("topic", SOURCE_TOPIC)
        .option("startingOffsets", "earliest")
        .option("maxEventsPerTrigger", max_events_per_trigger)
        .load()
        .select(F.from_json(F.col("payload").cast("string"), READING_SCHEMA).alias("r"))
        .select("r.sensor", "r.value", F.timestamp_millis("r.event_time_ms").alias("event_time"))
    )
    return (
        readings.withWatermark("event_time", f"{WATERMARK_S} seconds")
        .groupBy(F.window("event_time", f"{WINDOW_S} seconds"), "sensor")
        .agg(
            F.count("*").alias("readings"),
            F.round(F.avg("value"), 3).alias("mean"),
            F.max("value").alias("max"),
        )
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "sensor",
            "readings",
            "mean",
            "max",
        )
    )


def sink_writers(
    spark: Any, gateway: str, work_dir: Path, *, available_now: bool, per_trigger: int
) -> dict[str, Any]:
    """The two sinks of the same windows, not started: the Squall topic and Parquet."""
    from pyspark.sql import functions as F

    windows = windowed(spark, gateway, per_trigger)
    to_topic = (
        windows.select(
            F.col("sensor").alias("key"),
            F.to_json(
                F.struct("window_start", "window_end", "sensor", "readings", "mean", "max")
            ).alias("payload"),
        )
        .writeStream.format("squall")
        .option("gateway", gateway)
        .option("topic", SINK_TOPIC)
        .option("checkpointLocation", str(work_dir / "checkpoints" / "squall"))
    )
    to_parquet = (
        windows.writeStream.format("parquet")
        .option("path", str(work_dir / "parquet"))
        .option("checkpointLocation", str(work_dir / "checkpoints" / "parquet"))
    )
    writers = {"windows-to-squall": to_topic, "windows-to-parquet": to_parquet}
    for name, writer in writers.items():
        writer.queryName(name).outputMode("append")
        if available_now:
            writer.trigger(availableNow=True)
        else:
            writer.trigger(processingTime="5 seconds")
    return writers


# --- the demo -----------------------------------------------------------------------


def readings(start_s: int, seconds: int, seed: int) -> list[dict[str, Any]]:
    """Simulated readings for `seconds` of event time from start_s, some of them late."""
    rng = random.Random(seed)
    out: list[tuple[float, dict[str, Any]]] = []
    for second in range(seconds):
        for sensor_index, sensor in enumerate(SENSORS):
            for i in range(READINGS_PER_SECOND):
                event_ms = (start_s + second) * 1000 + i * (1000 // READINGS_PER_SECOND)
                base = 20 + 10 * sensor_index + 5 * math.sin((start_s + second) / 17)
                reading = {
                    "sensor": sensor,
                    "value": round(base + rng.gauss(0, 1), 2),
                    "event_time_ms": event_ms,
                }
                # Arrival order: mostly in event time, one in ten up to LATE_S_MAX late.
                late = rng.uniform(0, LATE_S_MAX) if rng.random() < 0.1 else 0.0
                out.append((event_ms / 1000 + late, reading))
    out.sort(key=lambda pair: pair[0])
    return [reading for _, reading in out]


def publish_readings(gateway: str, rows: list[dict[str, Any]]) -> None:
    """Publishes the readings, keyed by sensor."""
    with squall.connect(gateway) as client, client.topic(SOURCE_TOPIC).publisher() as publisher:
        publisher.publish_many((r["sensor"].encode(), json.dumps(r).encode()) for r in rows)


def ensure_topics(gateway: str) -> None:
    """Creates the source and sink topics unless they exist."""
    with squall.connect(gateway) as client:
        for name in (SOURCE_TOPIC, SINK_TOPIC):
            try:
                client.create_topic(name)
            except squall.AlreadyExists:
                pass


def last_event_s(gateway: str) -> int | None:
    """The latest event time already in the source topic (a re-run continues after it)."""
    with squall.connect(gateway) as client:
        topic = client.topic(SOURCE_TOPIC)
        if topic.info.next_offset == 0:
            return None
        start = max(0, topic.info.next_offset - 500)
        with topic.subscribe(start=start, follow=False) as subscription:
            return int(max(json.loads(m.payload)["event_time_ms"] for m in subscription)) // 1000


Windows = dict[tuple[int, str], tuple[int, float, float]]


def expected_windows(gateway: str) -> Windows:
    """Every window the watermark has closed, computed in plain Python from the raw readings."""
    with (
        squall.connect(gateway) as client,
        client.topic(SOURCE_TOPIC).subscribe(follow=False) as subscription,
    ):
        rows = [json.loads(m.payload) for m in subscription]
    watermark_ms = max(r["event_time_ms"] for r in rows) - WATERMARK_S * 1000
    groups: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in rows:
        start_ms = r["event_time_ms"] - r["event_time_ms"] % (WINDOW_S * 1000)
        groups[(start_ms, r["sensor"])].append(r["value"])
    result = {}
    for (start_ms, sensor), values in groups.items():
        if start_ms + WINDOW_S * 1000 <= watermark_ms:
            result[(start_ms // 1000, sensor)] = (
                len(values),
                sum(values) / len(values),
                max(values),
            )
    return result


def _same(spark_row: tuple[int, float, float], python_row: tuple[int, float, float]) -> bool:
    """Counts and maxima equal; means equal to Spark's 3-decimal rounding."""
    count, mean, high = spark_row
    return (count, high) == python_row[::2] and abs(mean - python_row[1]) < 0.0011


def check(spark: Any, gateway: str, work_dir: Path) -> bool:
    """Reads both sinks back and compares them with the plain-Python windows."""
    from pyspark.sql import functions as F

    topic_rows = (
        spark.read.format("squall")
        .option("gateway", gateway)
        .option("topic", SINK_TOPIC)
        .load()
        .select(
            F.from_json(
                F.col("payload").cast("string"),
                "window_start timestamp, window_end timestamp, sensor string, "
                "readings long, mean double, max double",
            ).alias("w")
        )
        .select("w.*")
        .orderBy("window_start", "sensor")
        .collect()
    )
    print(f"\n{SINK_TOPIC}: {len(topic_rows)} closed windows (read back with the batch reader)")
    print(f"  {'window start (UTC)':<20} {'sensor':<8} {'readings':>8} {'mean':>8} {'max':>7}")
    for row in topic_rows[-8:]:
        print(
            f"  {row.window_start:%Y-%m-%d %H:%M:%S} {row.sensor:<8} {row.readings:>8} "
            f"{row.mean:>8.3f} {row.max:>7.2f}"
        )
    # Keyed by the window's start in epoch seconds (PySpark hands timestamps over as naive
    # local datetimes; .timestamp() reads them back in the same zone).
    got: Windows = {
        (int(r.window_start.timestamp()), r.sensor): (r.readings, r.mean, r.max) for r in topic_rows
    }
    parquet: Windows = {
        (int(r.window_start.timestamp()), r.sensor): (r.readings, r.mean, r.max)
        for r in spark.read.parquet(str(work_dir / "parquet")).collect()
    }
    expected = expected_windows(gateway)
    ok = True
    if len(got) != len(topic_rows):
        print("check FAILED: a window was written to the topic more than once")
        ok = False
    if got != parquet:
        print("check FAILED: the topic and the Parquet files disagree")
        ok = False
    if set(got) != set(expected) or any(not _same(got[k], expected[k]) for k in got):
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        wrong = sorted(k for k in set(got) & set(expected) if not _same(got[k], expected[k]))[:3]
        print(f"check FAILED against plain Python: missing {missing} extra {extra} wrong {wrong}")
        ok = False
    if ok:
        print(
            f"check OK: topic and Parquet hold the same {len(got)} windows, each once, equal "
            "to the plain-Python aggregation of every window the watermark has closed"
        )
    return ok


@contextmanager
def demo_cluster() -> Iterator[str]:
    """The `make run` cluster if one is up; else the same cluster, stopped by PID at the end.

    Started from the config `make run` uses, so the data it leaves in .run/data (the
    topics, which the checkpoints in .run/pipeline-demo refer to) is the same cluster's.
    """
    from deploy import launcher

    if launcher._running_pids():
        config = tomllib.loads((launcher.RUN_DIR / "cluster.toml").read_text())
        gateway = config["gateways"][0]["address"]
        print(f"demo: using the running local cluster, gateway {gateway}")
        yield gateway
        return
    if launcher.start(ROOT / "deploy" / "cluster.example.toml", demo=False) != 0:
        raise SystemExit("demo: the local cluster did not start")
    try:
        config = tomllib.loads((launcher.RUN_DIR / "cluster.toml").read_text())
        yield config["gateways"][0]["address"]
    finally:
        launcher.stop()


def run_available_now(spark: Any, gateway: str, work_dir: Path, per_trigger: int) -> None:
    """Runs each query until it has processed what is in the topic now.

    A query that fails is started again from its checkpoint (what checkpoints are for; on
    a busy machine Spark may give up waiting for a Python worker to start).
    """
    writers = sink_writers(spark, gateway, work_dir, available_now=True, per_trigger=per_trigger)
    for name, writer in writers.items():
        for attempt in range(1, QUERY_RESTARTS_MAX + 2):
            query = writer.start()
            try:
                query.awaitTermination()
                break
            except Exception as exc:
                reason = str(exc).splitlines()[0]
                if attempt > QUERY_RESTARTS_MAX:
                    raise SystemExit(f"demo: query {name} failed: {reason}") from None
                print(f"demo: query {name} stopped ({reason}); restarting from its checkpoint")
        batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
        rows = sum(p["numInputRows"] for p in batches)
        print(f"demo: query {name}: {len(batches)} micro-batches, {rows} readings")


def demo(work_dir: Path, seconds: int, per_trigger: int) -> int:
    """Publishes readings, runs the job twice (the second time from its checkpoints), checks."""
    from squall.spark import local_session

    with demo_cluster() as gateway:
        ensure_topics(gateway)
        spark = local_session("squall-pipeline-demo")
        try:
            ok = True
            for round_no in (1, 2):
                last = last_event_s(gateway)
                start_s = last + 1 if last is not None else int(time.time()) // WINDOW_S * WINDOW_S
                rows = readings(start_s, seconds, seed=start_s)
                publish_readings(gateway, rows)
                print(
                    f"\ndemo round {round_no}: published {len(rows)} readings of {len(SENSORS)} "
                    f"sensors, {seconds} s of event time from "
                    f"{time.strftime('%H:%M:%S', time.gmtime(start_s))} UTC, some up to "
                    f"{LATE_S_MAX} s late"
                )
                run_available_now(spark, gateway, work_dir, per_trigger)
                ok = check(spark, gateway, work_dir) and ok
            print(
                f"\nThe windows after the last watermark ({WATERMARK_S} s behind the newest "
                "reading) stay open until later readings close them: run the demo again and "
                "it resumes from its checkpoints in " + str(work_dir)
            )
            return 0 if ok else 1
        finally:
            spark.stop()


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gateway", help="host:port of a Squall gateway (the job)")
    parser.add_argument("--demo", action="store_true", help="publish readings, run, check")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=ROOT / ".run" / "pipeline-demo",
        help="checkpoints and Parquet output (default: .run/pipeline-demo)",
    )
    parser.add_argument("--seconds", type=int, default=60, help="demo: event time per round")
    parser.add_argument(
        "--max-events-per-trigger", type=int, default=400, help="readings per micro-batch"
    )
    args = parser.parse_args(argv)
    if args.demo:
        return demo(args.work_dir, args.seconds, args.max_events_per_trigger)
    if not args.gateway:
        parser.error("give --gateway host:port for the job, or --demo")
    from squall.spark import local_session

    ensure_topics(args.gateway)
    spark = local_session("squall-pipeline")
    writers = sink_writers(
        spark,
        args.gateway,
        args.work_dir,
        available_now=False,
        per_trigger=args.max_events_per_trigger,
    )
    queries = [writer.start() for writer in writers.values()]
    print(f"pipeline running: {SOURCE_TOPIC} -> {SINK_TOPIC} and {args.work_dir / 'parquet'}")
    try:
        spark.streams.awaitAnyTermination()
    except KeyboardInterrupt:
        pass
    finally:
        for query in queries:
            query.stop()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
