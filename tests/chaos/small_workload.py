"""A small real workload for the harness's own tests (the full one is chaos/workload.py).

Idempotent publishers through the gateways, one event per publish, each recorded in the
history (invoke / complete). A publisher that meets an error moves to the other gateway
with a new publisher of the same id, continuing after the last sequence it sent, so a
retried publish can never be stored twice. One durable subscriber per topic reads what
is committed (``follow=False`` passes, acking each pass) and records ``deliver``; at
stop it keeps reading, bounded, until it has everything acknowledged.
``acknowledged`` and ``delivered`` say what happened; ``check_final_logs`` compares
them with the nodes' final logs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import squall
from chaos.history import HistoryWriter

_CREATE_TIMEOUT_S = 60.0
_PUBLISH_PAUSE_S = 0.02
# Definite failures: the event was not stored.
_DEFINITE = (squall.InvalidArgument, squall.ResourceExhausted, squall.NotFound)


class SmallWorkload:
    """Publishers over the target's gateways (see the module docstring)."""

    def __init__(
        self, target: Any, history: HistoryWriter, seed: int, topics: list[str], publishers: int = 2
    ) -> None:
        self.gateways: list[str] = list(target.gateway_addresses)
        self.history = history
        self.seed = seed
        self.topics = topics
        self.publishers = publishers
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.acknowledged: list[tuple[str, int, str]] = []  # topic, offset, value
        self.delivered: dict[tuple[str, int], str] = {}  # (topic, offset) -> value
        self._publishing = threading.Event()
        self._drain_until = 0.0
        self.counts = {"ok": 0, "fail": 0, "indeterminate": 0}
        self._lock = threading.Lock()

    async def start(self) -> None:
        await asyncio.to_thread(self._create_topics)
        self._publishing.set()
        for index in range(self.publishers):
            thread = threading.Thread(
                target=self._publish_loop, args=(index,), name=f"pub-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._subscribers = [
            threading.Thread(target=self._subscribe_loop, args=(i, topic), daemon=True)
            for i, topic in enumerate(self.topics)
        ]
        for thread in self._subscribers:
            thread.start()

    def _subscribe_loop(self, index: int, topic: str) -> None:
        process = f"sub-{index}"
        subscription = f"chaos-sub-{index}"
        gateway = index
        # Bounded: while publishing, then until everything acknowledged on this topic is
        # delivered or the drain deadline passes.
        while self._publishing.is_set() or (
            time.monotonic() < self._drain_until and not self._has_all(topic)
        ):
            address = self.gateways[gateway % len(self.gateways)]
            try:
                with squall.connect(address, timeout_s=5, retry_total_ms_max=3000) as client:
                    with client.topic(topic).subscribe(subscription, follow=False) as reader:
                        events = []
                        last = None
                        for message in reader:
                            events.append(
                                {"offset": message.offset, "value": message.payload.decode()}
                            )
                            last = message
                        if last is not None:
                            self.history.write(
                                "deliver",
                                process=process,
                                mode="stream",
                                topic=topic,
                                subscription=subscription,
                                events=events,
                            )
                            with self._lock:
                                for event in events:
                                    self.delivered[(topic, event["offset"])] = event["value"]
                            reader.ack(last)
            except squall.SquallError:
                gateway += 1
            time.sleep(0.2)

    def _has_all(self, topic: str) -> bool:
        with self._lock:
            return all(
                (t, offset) in self.delivered for t, offset, _ in self.acknowledged if t == topic
            )

    def _create_topics(self) -> None:
        deadline = time.monotonic() + _CREATE_TIMEOUT_S
        for topic in self.topics:
            while True:
                try:
                    with squall.connect(self.gateways[0], timeout_s=5) as client:
                        client.create_topic(topic)
                    break
                except squall.AlreadyExists:
                    break
                except squall.SquallError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def _publish_loop(self, index: int) -> None:
        process = f"pub-{index}"
        topic = self.topics[index % len(self.topics)]
        publisher_id = f"chaos-{self.seed}-{index}"
        sequence, number, gateway = 1, 0, index
        # Bounded by stop(): every pass publishes once or reconnects.
        while not self._stop.is_set():
            address = self.gateways[gateway % len(self.gateways)]
            try:
                client = squall.connect(address, timeout_s=5, retry_total_ms_max=5000)
            except squall.SquallError:
                gateway += 1
                time.sleep(0.2)
                continue
            try:
                publisher = client.topic(topic).publisher(publisher_id, start_sequence=sequence)
                while not self._stop.is_set():
                    number += 1
                    value = f"{process}-{number}"
                    op = self.history.new_op_id()
                    self.history.write(
                        "invoke",
                        id=op,
                        process=process,
                        op="publish",
                        path="gateway",
                        topic=topic,
                        publisher_id=publisher_id,
                        events=[{"seq": sequence, "value": value}],
                    )
                    sequence += 1
                    try:
                        receipt = publisher.publish(value.encode())
                    except squall.SquallError as exc:
                        outcome = "fail" if isinstance(exc, _DEFINITE) else "indeterminate"
                        self._complete(op, outcome, f"{type(exc).__name__}: {exc}", [])
                        raise
                    self._complete(op, "ok", None, [receipt.offset])
                    with self._lock:
                        self.acknowledged.append((topic, receipt.offset, value))
                    time.sleep(_PUBLISH_PAUSE_S)
            except squall.SquallError:
                gateway += 1
                time.sleep(0.2)
            finally:
                try:
                    client.close()
                except squall.SquallError:
                    pass

    def _complete(self, op: int, outcome: str, error: str | None, offsets: list[int]) -> None:
        with self._lock:
            self.counts[outcome] += 1
        self.history.write("complete", id=op, outcome=outcome, error=error, offsets=offsets)

    async def stop(self, drain_timeout_s: float) -> None:
        self._stop.set()
        deadline = time.monotonic() + drain_timeout_s
        self._drain_until = deadline
        for thread in self._threads:
            await asyncio.to_thread(thread.join, max(0.1, deadline - time.monotonic()))
        self._publishing.clear()
        for thread in getattr(self, "_subscribers", []):
            await asyncio.to_thread(thread.join, max(0.1, deadline - time.monotonic() + 5))


def check_final_logs(
    acknowledged: Sequence[tuple[str, int, str]],
    final_logs: Sequence[Mapping[str, Any]],
    delivered: Mapping[tuple[str, int], str] | None = None,
) -> list[str]:
    """Violations: an acknowledged event missing (or at another offset) on a node or
    (when delivered is given) never delivered to the subscriber, a value stored twice,
    or two nodes whose committed logs of a topic differ."""
    problems: list[str] = []
    for topic, offset, value in acknowledged if delivered is not None else ():
        got = delivered.get((topic, offset)) if delivered is not None else None
        if got != value:
            problems.append(f"acknowledged {value!r} at {topic}@{offset}: delivered {got!r}")
    by_node_topic: dict[tuple[str, str], dict[int, str]] = {}
    for record in final_logs:
        events = {int(offset): str(value) for offset, value in record["events"]}
        by_node_topic[(record["node"], record["topic"])] = events
        values = [str(value) for _, value in record["events"]]
        if len(values) != len(set(values)):
            problems.append(f"{record['node']} {record['topic']}: a value is stored twice")
    nodes = sorted({node for node, _ in by_node_topic})
    topics = sorted({topic for _, topic in by_node_topic})
    for topic, offset, value in acknowledged:
        for node in nodes:
            stored = by_node_topic.get((node, topic), {}).get(offset)
            if stored != value:
                problems.append(
                    f"acknowledged {value!r} at {topic}@{offset} is {stored!r} on {node}"
                )
    for topic in topics:
        logs = {node: by_node_topic.get((node, topic)) for node in nodes}
        if len({repr(sorted(log.items())) if log else "" for log in logs.values()}) > 1:
            sizes = {node: len(log or {}) for node, log in logs.items()}
            problems.append(f"{topic}: the nodes' committed logs differ (events {sizes})")
    return problems
