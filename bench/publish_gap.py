"""Publish gap across a master kill, and publish-to-delivery latency (issue 5, item 9).

Three nodes from deploy/cluster.example.toml with its default settings, run as real
processes on loopback (replica and coordinator per node, one gateway), 100-byte events.

* Publish gap: a publisher sends one event at a time, each waiting for its receipt, in a
  bounded loop on its own thread. Each trial waits until the cluster is settled (every
  coordinator NORMAL in one group, the master's replica master and the others slaves)
  and the publisher has a few receipts from the master, kills both of the master node's
  processes with SIGKILL, and times from just before the kill to the first receipt that
  arrives afterwards from another master (a receipt from the victim still on the wire is
  not the next acknowledged publish). The victim is then restarted and the cluster
  settles before the next trial. Once through the gateway (the default publisher) and
  once through a replicated publisher proxy (`publisher(replicated=True)`), each over its
  own topic and its own series of trials. The wait for the receipt is a condition
  variable signalled by the publisher thread, so no polling interval is added.
* Delivery latency: a following subscriber through the gateway and a paced
  `publish_async` publisher; each payload carries the publisher's monotonic clock, so
  latency is the time from the publish call to the app's loop receiving the message.

Every loop has a count and a deadline.
"""

from __future__ import annotations

import collections
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

import squall
from bench import replicated, single_node
from squall.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from squall_server.coordinator.election import rank_order

# The aim for the gap, default settings.
AIM = "p50 <= 500 ms, max <= 1000 ms (default settings, loopback)"
AIM_P50_MS = 500.0
AIM_MAX_MS = 1000.0
# Receipts from the master a trial waits for before the kill: the publisher is steady.
STEADY_RECEIPTS = 20
STEADY_TIMEOUT_S = 30.0
# Longest a trial waits for the first receipt after the kill before it counts as failed.
GAP_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 60.0
SETTLE_POLL_S = 0.05
# The gap publisher stops after this many events whatever happens (a loop bound).
GAP_EVENTS_MAX = 10_000_000
DELIVERY_RATE_PER_S = 500
DELIVERY_WARMUP_EVENTS = 200
DELIVERY_TAIL_TIMEOUT_S = 30.0
_STAMP = struct.Struct("<qQ")


@dataclass(frozen=True)
class Sizes:
    """How many gap trials per publisher kind, and how many delivery events."""

    trials: int
    delivery_events: int

    @classmethod
    def full(cls) -> Sizes:
        """The full run: about three minutes."""
        return cls(trials=10, delivery_events=3_000)

    @classmethod
    def quick(cls) -> Sizes:
        """A smoke run: about a minute."""
        return cls(trials=3, delivery_events=500)


class _Publishing(threading.Thread):
    """Publishes one event at a time until stopped, noting when each receipt arrived."""

    def __init__(self, publisher: squall.Publisher) -> None:
        super().__init__(daemon=True, name="gap-publisher")
        self._publisher = publisher
        self.stop = threading.Event()
        self.cond = threading.Condition()
        # (monotonic time the receipt arrived, master that acknowledged it)
        self.receipts: list[tuple[float, str]] = []
        self.by_master: collections.Counter[str] = collections.Counter()
        # Each receipt's offset, to check afterwards that every one is stored.
        self.offsets: list[int] = []
        # (monotonic time the call failed, error)
        self.failures: list[tuple[float, str]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        payload = single_node.payloads(1)[0]
        try:
            for _ in range(GAP_EVENTS_MAX):
                if self.stop.is_set():
                    return
                try:
                    receipt = self._publisher.publish(payload)
                except squall.SquallError as exc:
                    # An error the library's retries did not absorb: the app would try
                    # again, and so does this loop; the gap keeps running meanwhile.
                    with self.cond:
                        self.failures.append((time.monotonic(), repr(exc)))
                    continue
                with self.cond:
                    self.receipts.append((time.monotonic(), receipt.master_id))
                    self.by_master[receipt.master_id] += 1
                    self.offsets.append(receipt.offset)
                    self.cond.notify_all()
        except BaseException as exc:  # reported by the trial
            self.error = exc
            with self.cond:
                self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Waits (on the receipt signal) until predicate holds; TimeoutError at the deadline."""
        with self.cond:
            if not self.cond.wait_for(lambda: predicate() or self.error is not None, timeout_s):
                raise TimeoutError(f"not within {timeout_s} s: {what}")
        if self.error is not None:
            raise RuntimeError(f"the publisher loop failed: {self.error!r}") from self.error


def all_normal(cluster: replicated._Bench) -> str | None:
    """The master if every node is NORMAL in one group led by the highest-ranked node,
    else None."""
    statuses: dict[str, coordinator_pb2.CoordinatorStatus] = {}
    for node in cluster.config.nodes:
        with grpc.insecure_channel(node.coordinator_address) as channel:
            try:
                statuses[node.id] = coordinator_pb2_grpc.CoordinatorStub(channel).GetStatus(
                    coordinator_pb2.GetStatusRequest(), timeout=0.5
                )
            except grpc.RpcError:
                return None
    coordinators = {s.coordinator_id for s in statuses.values()}
    epochs = {s.epoch for s in statuses.values()}
    if len(coordinators) != 1 or len(epochs) != 1:
        return None
    master = coordinators.pop()
    for node_id, status in statuses.items():
        role = common_pb2.ROLE_MASTER if node_id == master else common_pb2.ROLE_SLAVE
        if status.state != common_pb2.NODE_STATE_NORMAL or status.role != role:
            return None
    # Every node is in the group, so a higher-ranked one that rejoined is catching up to
    # be handed the lead (docs/replication.md): not settled until it leads.
    top = rank_order({node.id: node.priority for node in cluster.config.nodes})[0]
    if master != top:
        return None
    return master if cluster.master() == master else None


def settle(cluster: replicated._Bench) -> str:
    """Waits until every node is NORMAL in one group (see all_normal); returns the master."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        master = all_normal(cluster)
        if master is not None:
            return master
        time.sleep(SETTLE_POLL_S)
    raise TimeoutError(f"the cluster did not settle within {SETTLE_TIMEOUT_S} s")


def gap_trials(
    cluster: replicated._Bench,
    publisher: squall.Publisher,
    trials: int,
    label: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Runs `trials` kills of the master under one publisher; returns the gap figures."""
    app = _Publishing(publisher)
    app.start()
    gaps_ms: list[float] = []
    failed_calls: list[int] = []
    try:
        for trial in range(trials):
            victim = settle(cluster)
            with app.cond:
                before = app.by_master[victim]

            def steady(victim: str = victim, before: int = before) -> bool:
                return app.by_master[victim] >= before + STEADY_RECEIPTS

            app.wait_for(steady, STEADY_TIMEOUT_S, f"{STEADY_RECEIPTS} receipts from {victim}")
            with app.cond:
                seen = len(app.receipts)
                failures_before = len(app.failures)
            killed_at = time.monotonic()
            cluster.kill_node(victim)

            def next_receipt(victim: str = victim, seen: int = seen) -> bool:
                return any(m != victim for _, m in app.receipts[seen:])

            app.wait_for(next_receipt, GAP_TIMEOUT_S, f"a receipt after killing {victim}")
            with app.cond:
                acked_at, new_master = next((t, m) for t, m in app.receipts[seen:] if m != victim)
                failed_calls.append(len(app.failures) - failures_before)
            gaps_ms.append((acked_at - killed_at) * 1000)
            log(
                f"  {label} trial {trial + 1}/{trials}: killed {victim}, next receipt from "
                f"{new_master} after {gaps_ms[-1]:.0f} ms"
            )
            cluster.start_node(victim)
        settle(cluster)
    finally:
        app.stop.set()
        app.join(30)
    if app.error is not None:
        raise RuntimeError(f"the publisher loop failed: {app.error!r}") from app.error
    ordered = sorted(gaps_ms)
    return {
        "trials": trials,
        "p50_ms": round(statistics.median(ordered), 1),
        "max_ms": round(ordered[-1], 1),
        "min_ms": round(ordered[0], 1),
        "all_ms": [round(g, 1) for g in gaps_ms],
        "meets_aim": statistics.median(ordered) <= AIM_P50_MS and ordered[-1] <= AIM_MAX_MS,
        "failed_calls_per_trial": failed_calls,
        "receipts": len(app.receipts),
        "failures": [error for _, error in app.failures[:5]],
    }


def delivery_latency(address: str, topic: str, events: int) -> dict[str, Any]:
    """Paced publish_async through the gateway; latency to a following subscriber's loop."""
    total = DELIVERY_WARMUP_EVENTS + events
    filler = b"x" * (single_node.EVENT_BYTES - _STAMP.size)
    latencies_s: list[float] = []
    received = threading.Event()
    reader_error: list[BaseException] = []
    with squall.connect(address) as client:
        topic_handle = client.topic(topic)
        subscription = topic_handle.subscribe(start="earliest", follow=True)

        def consume() -> None:
            try:
                for message in subscription:
                    now_ns = time.perf_counter_ns()
                    sent_ns, index = _STAMP.unpack_from(message.payload)
                    if index >= DELIVERY_WARMUP_EVENTS:
                        latencies_s.append((now_ns - sent_ns) / 1e9)
                    if index == total - 1:
                        received.set()
                        return
            except BaseException as exc:  # reported below
                reader_error.append(exc)
                received.set()

        reader = threading.Thread(target=consume, daemon=True, name="delivery-reader")
        reader.start()
        interval_s = 1.0 / DELIVERY_RATE_PER_S
        with topic_handle.publisher() as publisher:
            started = time.perf_counter()
            for index in range(total):
                # Pacing: the publisher sends at a steady rate, as a live source would.
                wait_s = started + index * interval_s - time.perf_counter()
                if wait_s > 0:
                    time.sleep(wait_s)
                publisher.publish_async(_STAMP.pack(time.perf_counter_ns(), index) + filler)
            publisher.flush()
        complete = received.wait(DELIVERY_TAIL_TIMEOUT_S)
        subscription.close()
        reader.join(10)
    if reader_error:
        raise RuntimeError(f"the subscriber failed: {reader_error[0]!r}") from reader_error[0]
    latencies_s.sort()
    return {
        "events": len(latencies_s),
        "warmup_events": DELIVERY_WARMUP_EVENTS,
        "rate_per_s": DELIVERY_RATE_PER_S,
        "complete": complete and len(latencies_s) == events,
        "latency_ms_p50": round(1000 * single_node.percentile(latencies_s, 0.50), 2),
        "latency_ms_p99": round(1000 * single_node.percentile(latencies_s, 0.99), 2),
        "latency_ms_max": round(1000 * (latencies_s[-1] if latencies_s else 0.0), 2),
    }


def run(sizes: Sizes, temp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The delivery latency, then the gap trials through the gateway and a proxy."""
    results: dict[str, Any] = {"aim": AIM, "template": "deploy/cluster.example.toml"}
    with replicated.running(temp) as cluster:
        address = cluster.gateway_address
        with squall.connect(address) as client:
            for topic in ("bench-delivery", "bench-gap-gateway", "bench-gap-proxy"):
                client.create_topic(topic)
            settle(cluster)
            log(f"bench: publish_gap, delivery latency ({sizes.delivery_events} events)")
            results["delivery"] = delivery_latency(address, "bench-delivery", sizes.delivery_events)
            for label, topic, kind in (
                ("gateway", "bench-gap-gateway", None),
                ("replicated_proxy", "bench-gap-proxy", True),
            ):
                log(f"bench: publish_gap, {label}, {sizes.trials} trials (kill -9 of the master)")
                publisher = client.topic(topic).publisher(replicated=kind)
                try:
                    results[label] = gap_trials(cluster, publisher, sizes.trials, label, log)
                finally:
                    publisher.close()
    return results


def table(results: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    lines = [
        "| publish gap (3 nodes, defaults; kill -9 of the master to the next receipt) "
        "| p50 ms | max ms | trials |",
        "|---|---:|---:|---:|",
    ]
    for label, name in (
        ("gateway", "through the gateway"),
        ("replicated_proxy", "replicated proxy"),
    ):
        figures = results.get(label)
        if figures:
            lines.append(
                f"| {name} | {figures['p50_ms']} | {figures['max_ms']} | {figures['trials']} |"
            )
    delivery = results.get("delivery")
    if delivery:
        lines.append(
            f"| publish-to-delivery, following subscriber via the gateway "
            f"({delivery['events']:,} events at {delivery['rate_per_s']}/s; p50 / p99 ms) "
            f"| {delivery['latency_ms_p50']} | {delivery['latency_ms_p99']} (p99) | - |"
        )
    lines.append(f"aim: {AIM}")
    return "\n".join(lines)
