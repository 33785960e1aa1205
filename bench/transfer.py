"""Publish gap across a graceful leadership transfer (`squall cluster transfer`, issue 6).

Three nodes from deploy/cluster.example.toml with its default settings, real processes on
loopback (replica and coordinator per node, one gateway), 100-byte events. A publisher
sends one event at a time through the gateway, each waiting for its receipt, on its own
thread (``publish_gap._Publishing``). Each trial waits until the cluster is settled and the
publisher has a few receipts from the master, then asks the master's coordinator to hand
over to the next node in id order (``TransferLeadership``, the RPC the CLI sends), and
records:

* ``gap``: from the last receipt the old master acknowledged to the first receipt from
  the new one — the pause the publisher sees;
* ``handover``: from the request to that first receipt from the new master.

The next trial hands over again from the new master, so the role goes round the nodes.
Afterwards every receipt's event is read back from the last master: an acknowledged event
missing there would be a lost write (the figures say how many: it must be 0). Every loop
has a count and a deadline.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

import squall
from bench import publish_gap, replicated
from squall.v1 import broker_pb2, broker_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc

AIM = "a gap well under the failover gap (p50 ~450 ms): no detection timeout to wait for"
STEADY_RECEIPTS = 20
GAP_TIMEOUT_S = 30.0
TRANSFER_WAIT_MS = 5000
TOPIC = "bench-transfer"


@dataclass(frozen=True)
class Sizes:
    """How many transfers."""

    trials: int

    @classmethod
    def full(cls) -> Sizes:
        """The full run (about a minute)."""
        return cls(trials=12)

    @classmethod
    def quick(cls) -> Sizes:
        """A smoke run."""
        return cls(trials=3)


def _transfer(cluster: replicated._Bench, master: str, target: str) -> None:
    """Asks the master's coordinator to hand over to target (what the CLI does)."""
    address = cluster.config.node(master).coordinator_address
    with grpc.insecure_channel(address) as channel:
        coordinator_pb2_grpc.CoordinatorStub(channel).TransferLeadership(
            coordinator_pb2.TransferLeadershipRequest(
                target=target, operator="bench", reason="bench", timeout_ms=TRANSFER_WAIT_MS
            ),
            timeout=TRANSFER_WAIT_MS / 1000 + 5,
        )


def _stored_offsets(address: str) -> set[int]:
    """Every committed offset of the bench topic on one replica."""
    offsets: set[int] = set()
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=TOPIC, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=1000
            ),
            timeout=60,
        )
        for response in stream:
            offsets.update(event.offset for event in response.events)
    return offsets


def run(sizes: Sizes, temp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Runs `sizes.trials` transfers under a publisher; returns the figures (ms)."""
    gaps_ms: list[float] = []
    handovers_ms: list[float] = []
    moves: list[str] = []
    with replicated.running(temp) as cluster:
        nodes = sorted(n.id for n in cluster.config.nodes)
        with squall.connect(cluster.gateway_address) as client:
            client.create_topic(TOPIC)
            publisher = client.topic(TOPIC).publisher()
            app = publish_gap._Publishing(publisher)
            app.start()
            try:
                for trial in range(sizes.trials):
                    master = publish_gap.settle(cluster)
                    target = nodes[(nodes.index(master) + 1) % len(nodes)]
                    with app.cond:
                        before = app.by_master[master]

                    def steady(master: str = master, before: int = before) -> bool:
                        return app.by_master[master] >= before + STEADY_RECEIPTS

                    app.wait_for(steady, 30.0, f"{STEADY_RECEIPTS} receipts from {master}")
                    with app.cond:
                        seen = len(app.receipts)
                    asked_at = time.monotonic()
                    _transfer(cluster, master, target)

                    def moved(target: str = target, seen: int = seen) -> bool:
                        return any(m == target for _, m in app.receipts[seen:])

                    app.wait_for(moved, GAP_TIMEOUT_S, f"a receipt from {target}")
                    with app.cond:
                        first_new = next(t for t, m in app.receipts[seen:] if m == target)
                        last_old = max(t for t, m in app.receipts if m == master and t < first_new)
                    gaps_ms.append((first_new - last_old) * 1000)
                    handovers_ms.append((first_new - asked_at) * 1000)
                    moves.append(f"{master}->{target}")
                    log(
                        f"  transfer trial {trial + 1}/{sizes.trials}: {master} -> {target}, "
                        f"publisher gap {gaps_ms[-1]:.0f} ms, hand-over {handovers_ms[-1]:.0f} ms"
                    )
                last_master = publish_gap.settle(cluster)
            finally:
                app.stop.set()
                app.join(30)
                publisher.close()
        if app.error is not None:
            raise RuntimeError(f"the publisher loop failed: {app.error!r}") from app.error
        stored = _stored_offsets(cluster.config.node(last_master).replica_address)
    lost = [offset for offset in app.offsets if offset not in stored]
    return {
        "trials": sizes.trials,
        "gap_p50_ms": round(statistics.median(gaps_ms), 1),
        "gap_max_ms": round(max(gaps_ms), 1),
        "gap_min_ms": round(min(gaps_ms), 1),
        "gap_all_ms": [round(g, 1) for g in gaps_ms],
        "handover_p50_ms": round(statistics.median(handovers_ms), 1),
        "handover_max_ms": round(max(handovers_ms), 1),
        "moves": moves,
        "receipts": len(app.offsets),
        "acknowledged_but_lost": len(lost),
        "failed_calls": len(app.failures),
        "failures": [error for _, error in app.failures[:5]],
        "aim": AIM,
    }


def table(results: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    return "\n".join(
        [
            "| leadership transfer (3 nodes, defaults; publisher through the gateway) "
            "| p50 ms | max ms | trials |",
            "|---|---:|---:|---:|",
            f"| publisher gap (last receipt from the old master to the first from the new) "
            f"| {results['gap_p50_ms']} | {results['gap_max_ms']} | {results['trials']} |",
            f"| hand-over (request to the first receipt from the new master) "
            f"| {results['handover_p50_ms']} | {results['handover_max_ms']} "
            f"| {results['trials']} |",
            f"acknowledged events lost: {results['acknowledged_but_lost']} of "
            f"{results['receipts']}; failed calls: {results['failed_calls']}",
        ]
    )
