"""Consumer benchmarks (issue 18 item 5): shared subscriptions, reads from replicas, push.

    python -m bench.consumers                # the default sizes, about a minute
    python -m bench.consumers --tiny         # a smoke run, seconds
    python -m bench.consumers --read-events 20000 --readers 3 --rounds 3

One three-node cluster (deploy/cluster.example.toml, the default durability), one
gateway, 100-byte events, everything through the gateway with the client library:

* **shared**: a topic of `shared_events` events read by a shared subscription with 1, 4
  and 16 consumers (threads of this process, each `topic.shared(...)`, acking every
  message on its own): events acknowledged per second, and each ack's latency (the
  `message.ack()` call, a replicated log entry on the master), p50 and p99. Beside them,
  measured in the same run: a bare unary round trip through the gateway (`topics()`), and
  one publish waiting for its receipt (also a replicated entry), as the floor the ack
  latency is read against.
* **replica reads**: `readers` reader processes each read the same prefilled topic
  (`read_events` events) from the start, non-following, while one publisher publishes
  batches of 500 into another topic; once with every stream on the master
  (`read_from="master"`), once spread over the three replicas (`read_from="replicas"`),
  alternating `rounds` times so drift in the machine's load hits both alike. Consume
  rate = all events read / (last reader's end - first reader's start); the publish rate is
  the publisher's (calls of 100 events) over the same window, and alone over the second
  before the readers start. The ratios replicas / master are the figures.

* **push**: a prefilled topic of `push_events` events pushed from the earliest offset to
  one push subscriber (`squall.PushEndpoint` in this process, a callback that counts),
  once `reliability="ordered"` (one batch in flight) and once unordered (up to
  `limits.push_inflight_batches_max` batches in flight): events delivered per second,
  from the subscribe call to the last event's arrival, and events per `Deliver` call.
  Duplicates (a batch offered again) are counted apart, not as throughput.

The readers are processes (spawned before the clock starts), so the client's GIL does not
cap the consume rate; every stream still passes through the one gateway, which is part of
what is measured. A measurement, not a test: it fails only if the cluster cannot start or
a call fails, never because a figure is low. Every loop has a count and a deadline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import squall
from bench import machine, replicated
from bench.single_node import percentile

EVENT = b"x" * 100
BATCH_EVENTS = 500
CONSUMER_COUNTS = (1, 4, 16)
# Events per publish call of the publisher running beside the readers (small, so the
# rate over a short window counts many calls), and how long it runs alone first.
PUBLISH_EVENTS = 100
PUBLISH_ALONE_S = 1.0
# Round trips timed for the floor figures.
FLOOR_CALLS = 200


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does."""

    shared_events: int
    read_events: int
    readers: int
    rounds: int
    deadline_s: float
    push_events: int

    @classmethod
    def default(cls) -> Sizes:
        """What `make bench` runs."""
        return cls(
            shared_events=10_000,
            read_events=100_000,
            readers=6,
            rounds=2,
            deadline_s=120,
            push_events=50_000,
        )

    @classmethod
    def tiny(cls) -> Sizes:
        """A smoke run."""
        return cls(
            shared_events=300,
            read_events=3_000,
            readers=3,
            rounds=1,
            deadline_s=30,
            push_events=2_000,
        )


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _floor(address: str) -> dict[str, float]:
    """p50 of a bare unary round trip through the gateway and of one replicated publish."""
    trips: list[float] = []
    publishes: list[float] = []
    with squall.connect(address) as client:
        client.create_topic("bench-floor")
        publisher = client.topic("bench-floor").publisher()
        for _ in range(FLOOR_CALLS):
            started = time.perf_counter()
            client.topics()
            trips.append(time.perf_counter() - started)
            started = time.perf_counter()
            publisher.publish(EVENT)
            publishes.append(time.perf_counter() - started)
        publisher.close()
    return {
        "round_trip_p50_ms": _ms(statistics.median(trips)),
        "publish_p50_ms": _ms(statistics.median(publishes)),
    }


def _fill(address: str, topic: str, events: int) -> None:
    with squall.connect(address) as client:
        client.create_topic(topic)
        with client.topic(topic).publisher() as publisher:
            publisher.publish_many([EVENT] * events, batch_events=BATCH_EVENTS)


def shared_run(
    address: str, topic: str, consumers: int, events: int, deadline_s: float
) -> dict[str, Any]:
    """`consumers` threads share one new subscription of `topic` until every event is acked."""
    name = f"work-{consumers}"
    latencies: list[float] = []
    lock = threading.Lock()
    acked = [0]
    refused = [0]
    done = threading.Event()
    errors: list[BaseException] = []
    with squall.connect(address) as client:
        handle = client.topic(topic)
        handle.create_shared_subscription(name, ack_deadline_ms=60_000)
        handles = [
            handle.shared(
                name, consumer_id=f"c{i}", max_messages=50, max_outstanding=200, wait_ms=200
            )
            for i in range(consumers)
        ]

        def consume(consumer: squall.SharedConsumer) -> None:
            mine: list[float] = []
            try:
                for message in consumer:
                    started = time.perf_counter()
                    try:
                        message.ack()
                    except squall.FailedPrecondition:
                        # Delivered again to another consumer (a failover forgot the
                        # leases, or the deadline passed): that one acks it, as in an app.
                        with lock:
                            refused[0] += 1
                        continue
                    mine.append(time.perf_counter() - started)
                    with lock:
                        acked[0] += 1
                        if acked[0] >= events:
                            done.set()
                    if done.is_set():
                        break
            except BaseException as exc:  # reported below
                errors.append(exc)
                done.set()
            finally:
                with lock:
                    latencies.extend(mine)

        threads = [threading.Thread(target=consume, args=(c,), daemon=True) for c in handles]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        finished = done.wait(deadline_s)
        elapsed = time.perf_counter() - started
        for consumer in handles:
            consumer.close()
        for thread in threads:
            thread.join(10)
    if errors:
        raise errors[0]
    ordered = sorted(latencies)
    return {
        "consumers": consumers,
        "events": acked[0],
        "seconds": round(elapsed, 3),
        "events_per_s": round(acked[0] / elapsed),
        "ack_p50_ms": _ms(percentile(ordered, 0.5)),
        "ack_p99_ms": _ms(percentile(ordered, 0.99)),
        "refused_acks": refused[0],
        "hit_deadline": not finished,
    }


def push_run(
    address: str, topic: str, events: int, reliability: str, deadline_s: float
) -> dict[str, Any]:
    """The first `events` events of `topic` pushed to one new subscriber from the earliest
    offset; from the subscribe call until the last of them arrived."""
    lock = threading.Lock()
    seen: set[int] = set()
    calls = [0]
    duplicates = [0]
    done = threading.Event()
    last_at = [0.0]

    def delivered(batch: squall.PushDelivery) -> None:
        with lock:
            calls[0] += 1
            for message in batch.messages:
                if message.offset >= events:
                    continue
                if message.offset in seen:
                    duplicates[0] += 1
                    continue
                seen.add(message.offset)
            if len(seen) >= events and not done.is_set():
                last_at[0] = time.perf_counter()
                done.set()

    subscriber = f"push-{reliability or 'unordered'}"
    with squall.connect(address) as client, squall.PushEndpoint() as endpoint:
        handle = client.topic(topic)
        started = time.perf_counter()
        handle.subscribe_push(
            subscriber,
            endpoint,
            reliability=reliability,  # type: ignore[arg-type]
            retry_count=-1,
            start="earliest",
            on_delivery=delivered,
        )
        finished = done.wait(deadline_s)
        handle.unsubscribe_push(subscriber)
    elapsed = (last_at[0] if finished else time.perf_counter()) - started
    return {
        "reliability": reliability or "unordered",
        "events": len(seen),
        "seconds": round(elapsed, 3),
        "events_per_s": round(len(seen) / elapsed),
        "deliver_calls": calls[0],
        "events_per_call": round(len(seen) / max(1, calls[0]), 1),
        "duplicates": duplicates[0],
        "hit_deadline": not finished,
    }


def _noop(_: int) -> None:
    """Makes a pool's processes start (and import squall) before the clock does."""


def _read_worker(job: tuple[str, str, int, str, float]) -> tuple[int, float, float]:
    """One reader process: (events read, wall-clock start, wall-clock end)."""
    address, topic, end, read_from, deadline_s = job
    count = 0
    with squall.connect(address) as client:
        subscription = client.topic(topic).subscribe(
            start="earliest",
            follow=False,
            end_offset=end,
            read_from=read_from,  # type: ignore[arg-type]
        )
        watchdog = threading.Timer(deadline_s, subscription.close)
        watchdog.start()
        started = time.time()  # wall clock: compared across processes
        try:
            for batch in subscription.batches():
                count += len(batch)
        finally:
            watchdog.cancel()
            subscription.close()
        return count, started, time.time()


def read_round(
    address: str,
    pool: Any,
    topic: str,
    publish_topic: str,
    sizes: Sizes,
    read_from: str,
) -> dict[str, Any]:
    """The readers once, all with `read_from`, while one publisher publishes."""
    stop = threading.Event()
    published = [0]

    def publish() -> None:
        with squall.connect(address) as client:
            with client.topic(publish_topic).publisher() as publisher:
                # Bounded by the readers' deadline: the round stops it.
                for _ in range(1_000_000):
                    if stop.is_set():
                        return
                    publisher.publish_many([EVENT] * PUBLISH_EVENTS, batch_events=PUBLISH_EVENTS)
                    published[0] += PUBLISH_EVENTS

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    time.sleep(0.5)  # the publisher at its pace before the readers start
    # The publish rate alone, just before the readers start: what reading costs it.
    alone_base, alone_started = published[0], time.time()
    time.sleep(PUBLISH_ALONE_S)
    alone = (published[0] - alone_base) / (time.time() - alone_started)
    base = published[0]
    window_started = time.time()
    jobs = [(address, topic, sizes.read_events, read_from, sizes.deadline_s)] * sizes.readers
    results = pool.map(_read_worker, jobs)
    window_ended = time.time()
    during = published[0] - base
    stop.set()
    publisher.join(30)
    total = sum(count for count, _, _ in results)
    first = min(started for _, started, _ in results)
    last = max(ended for _, _, ended in results)
    return {
        "read_from": read_from,
        "readers": sizes.readers,
        "events_read": total,
        "consume_events_per_s": round(total / (last - first)),
        "publish_events_per_s": round(during / (window_ended - window_started)),
        "publish_alone_events_per_s": round(alone),
        "complete": total == sizes.read_events * sizes.readers,
    }


def run(sizes: Sizes, run_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Every consumer scenario on one fresh cluster; the figures with the load average."""
    figures: dict[str, Any] = {"sizes": asdict(sizes), "load_average_start": machine.load_average()}
    with replicated.running(run_dir) as cluster:
        address = cluster.gateway_address
        figures["floor"] = _floor(address)
        _fill(address, "bench-shared", sizes.shared_events * len(CONSUMER_COUNTS))
        shared = []
        for count in CONSUMER_COUNTS:
            log(
                f"  consumers: shared subscription, {count} consumers, "
                f"{sizes.shared_events:,} events"
            )
            # Each count has its own subscription; all start at the earliest offset, so
            # each reads the first shared_events events of the one topic.
            shared.append(
                shared_run(address, "bench-shared", count, sizes.shared_events, sizes.deadline_s)
            )
        figures["shared"] = shared
        _fill(address, "bench-push", sizes.push_events)
        pushes = []
        for reliability in ("ordered", ""):
            log(f"  consumers: push, {reliability or 'unordered'}, {sizes.push_events:,} events")
            pushes.append(
                push_run(address, "bench-push", sizes.push_events, reliability, sizes.deadline_s)
            )
        figures["push"] = pushes
        _fill(address, "bench-reads", sizes.read_events)
        with squall.connect(address) as client:
            client.create_topic("bench-reads-publish")
        rounds: list[dict[str, Any]] = []
        context = multiprocessing.get_context("spawn")
        with context.Pool(sizes.readers) as pool:
            pool.map(_noop, range(sizes.readers))
            for index in range(sizes.rounds):
                pair = {}
                for read_from in ("master", "replicas"):
                    log(
                        f"  consumers: {sizes.readers} readers on {read_from}, round "
                        f"{index + 1}/{sizes.rounds}"
                    )
                    pair[read_from] = read_round(
                        address, pool, "bench-reads", "bench-reads-publish", sizes, read_from
                    )
                pair["consume_ratio"] = round(
                    pair["replicas"]["consume_events_per_s"]
                    / pair["master"]["consume_events_per_s"],
                    2,
                )
                pair["publish_ratio"] = round(
                    pair["replicas"]["publish_events_per_s"]
                    / max(1, pair["master"]["publish_events_per_s"]),
                    2,
                )
                rounds.append(pair)
        figures["replica_reads"] = {
            "rounds": rounds,
            "consume_ratio_median": statistics.median(r["consume_ratio"] for r in rounds),
            "publish_ratio_median": statistics.median(r["publish_ratio"] for r in rounds),
        }
    figures["load_average_end"] = machine.load_average()
    return figures


def section(figures: dict[str, Any] | None) -> list[str]:
    """The report's Markdown section."""
    lines = ["## Consumers (shared subscriptions, push, reads from replicas)", ""]
    if not figures:
        return [*lines, "Not measured in this run.", ""]
    floor = figures["floor"]
    lines += [
        f"Load average {figures['load_average_start']} at the start of this section, "
        f"{figures['load_average_end']} at its end. Floor in the same run: a bare round trip "
        f"through the gateway {floor['round_trip_p50_ms']} ms, one publish "
        f"{floor['publish_p50_ms']} ms (p50).",
        "",
        "| consumers | acked events/s | ack p50 ms | ack p99 ms | ack p50 / publish p50 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for run_ in figures["shared"]:
        ratio = run_["ack_p50_ms"] / floor["publish_p50_ms"] if floor["publish_p50_ms"] else 0
        lines.append(
            f"| {run_['consumers']} | {run_['events_per_s']:,} | {run_['ack_p50_ms']} | "
            f"{run_['ack_p99_ms']} | {ratio:.2f} |"
        )
    if figures.get("push"):
        lines += [
            "",
            "| push subscriber (one, this process) | events/s | events per Deliver call | "
            "offered again |",
            "|---|---:|---:|---:|",
        ]
        for push in figures["push"]:
            deadline = " (deadline hit)" if push["hit_deadline"] else ""
            lines.append(
                f"| {push['reliability']}{deadline} | {push['events_per_s']:,} | "
                f"{push['events_per_call']} | {push['duplicates']} |"
            )
    reads = figures["replica_reads"]
    lines += [
        "",
        "| round | readers | consume ev/s, master | consume ev/s, replicas | ratio | "
        "publish ev/s while reading, master (alone) | same, replicas (alone) | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, pair in enumerate(reads["rounds"], 1):
        master, spread = pair["master"], pair["replicas"]
        lines.append(
            f"| {index} | {master['readers']} | {master['consume_events_per_s']:,} | "
            f"{spread['consume_events_per_s']:,} | {pair['consume_ratio']} | "
            f"{master['publish_events_per_s']:,} ({master['publish_alone_events_per_s']:,}) | "
            f"{spread['publish_events_per_s']:,} ({spread['publish_alone_events_per_s']:,}) | "
            f"{pair['publish_ratio']} |"
        )
    lines += [
        "",
        f"Median ratios, replicas / master: consume {reads['consume_ratio_median']:.2f}, publish "
        f"while reading {reads['publish_ratio_median']:.2f}. See bench/consumers.py.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Runs the consumer benchmarks and prints the section and the JSON."""
    parser = argparse.ArgumentParser(prog="bench.consumers", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    for name in ("shared-events", "read-events", "readers", "rounds", "push-events"):
        parser.add_argument(f"--{name}", type=int, metavar="N", help="override the size")
    args = parser.parse_args(argv)
    sizes = Sizes.tiny() if args.tiny else Sizes.default()
    overrides = {
        key: getattr(args, key)
        for key in ("shared_events", "read_events", "readers", "rounds", "push_events")
        if getattr(args, key) is not None
    }
    if any(value < 1 for value in overrides.values()):
        parser.error("sizes must be >= 1")
    sizes = replace(sizes, **overrides)
    with tempfile.TemporaryDirectory(prefix="squall-bench-consumers-") as temp:
        figures = run(sizes, Path(temp), lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(section(figures)))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
