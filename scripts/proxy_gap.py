"""Measures the publisher-visible gap of each publishing path across master faults.

A development tool for issue 14 (item 3), not a test and not a benchmark: it starts a real
three-node cluster from deploy/cluster.example.toml on free loopback ports, runs three
apps publishing one event at a time — through the gateway, through a replicated proxy and
through a non-replicated proxy (which asks for a new proxy, same id and sequence, when it
raises PublisherLost) — and for each trial and fault prints, per path, how long after the
fault the first acknowledgement came and the longest interval without one.

Faults, in each trial: `kill`: kill -9 of the master node (both processes); `takeback`:
the killed node, of higher priority, restarted and taking the lead back; `replica`: kill
-9 of the master's replica alone, restarted 2 s later; `pause`: SIGSTOP of the master node
(both processes) for 5 s, then SIGCONT.

    .venv/bin/python -m scripts.proxy_gap --trials 3
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import squall
from tests.integration.conftest import ROOT, LocalCluster, make_cluster

_SETTLE_S = 3.0
_REPLICA_DOWN_S = 2.0
_PAUSE_S = 5.0
_WAIT_S = 60.0


class _App(threading.Thread):
    """Publishes one event at a time, recording when each acknowledgement arrived."""

    def __init__(self, name: str, publish: Callable[[int], squall.Receipt]) -> None:
        super().__init__(daemon=True, name=name)
        self.publish = publish
        self.acks: list[float] = []
        self.indeterminate = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        sequence = 1
        while not self.stop.is_set():
            try:
                self.publish(sequence)
            except squall.SquallError:
                with self.lock:
                    self.indeterminate += 1
                continue  # the same sequence again: the master stores it once
            with self.lock:
                self.acks.append(time.monotonic())
            sequence += 1

    def gap(self, fault_at: float, until: float) -> tuple[float, float]:
        """(first acknowledgement after the fault, longest interval without one), in s."""
        with self.lock:
            acks = [a for a in self.acks if a <= until]
        before = [a for a in acks if a <= fault_at]
        after = [a for a in acks if a > fault_at]
        if not after:
            return float("inf"), float("inf")
        points = [before[-1] if before else fault_at, *after]
        longest = max(b - a for a, b in itertools.pairwise(points))
        return after[0] - fault_at, longest


def _non_replicated(topic: squall.Topic) -> Callable[[int], squall.Receipt]:
    current = [topic.publisher("nonrep", replicated=False)]

    def publish(sequence: int) -> squall.Receipt:
        try:
            return current[0].publish(b"n%d" % sequence)
        except squall.PublisherLost:
            current[0].close()
            # Bounded by the caller's loop: a refused request is raised and tried again.
            current[0] = topic.publisher("nonrep", replicated=False, start_sequence=sequence)
            raise

    return publish


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {_WAIT_S} s: {what}")
        time.sleep(0.02)


def _report(kind: str, apps: list[_App], fault_at: float, until: float) -> None:
    cells = []
    for app in apps:
        first, longest = app.gap(fault_at, until)
        cells.append(f"{app.name} first={first:.2f}s longest={longest:.2f}s")
    print(f"{kind:9} " + " | ".join(cells), flush=True)


def _trial(cluster: LocalCluster, apps: list[_App]) -> None:
    def acked_since(mark: float) -> bool:
        return all(any(a > mark for a in list(app.acks)) for app in apps)

    master = cluster.wait_for_master()
    time.sleep(_SETTLE_S)
    fault_at = time.monotonic()
    cluster.kill_node(master)
    _wait(lambda: acked_since(fault_at + 1.0), "every path acknowledged after the kill")
    time.sleep(_SETTLE_S)
    _report("kill", apps, fault_at, time.monotonic())

    restart_at = time.monotonic()
    cluster.start_node(master)
    _wait(lambda: cluster.wait_for_master() == master, f"{master} leads again")
    time.sleep(_SETTLE_S)
    _report("takeback", apps, restart_at, time.monotonic())

    fault_at = time.monotonic()
    cluster.kill("replica", master)
    time.sleep(_REPLICA_DOWN_S)
    cluster.start("replica", master)
    _wait(lambda: acked_since(time.monotonic() - 0.5), "every path acknowledged again")
    time.sleep(_SETTLE_S)
    _report("replica", apps, fault_at, time.monotonic())

    master = cluster.wait_for_master()
    pids = [cluster.services[(kind, master)].process.pid for kind in ("coordinator", "replica")]
    fault_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(_PAUSE_S)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    _wait(lambda: acked_since(time.monotonic() - 0.5), "every path acknowledged again")
    time.sleep(_SETTLE_S)
    _report("pause", apps, fault_at, time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="squall-gap-") as run_dir:
        cluster = make_cluster(ROOT / "deploy" / "cluster.example.toml", Path(run_dir))
        try:
            cluster.start_all()
            with squall.connect(cluster.gateway_address, timeout_s=10.0) as client:
                client.create_topic("gap")
                topic = client.topic("gap")
                gateway = topic.publisher("gw")
                proxy = topic.publisher("rep", replicated=True)
                apps = [
                    _App("gateway", lambda s: gateway.publish(b"g%d" % s)),
                    _App("replicated", lambda s: proxy.publish(b"r%d" % s)),
                    _App("non-replicated", _non_replicated(topic)),
                ]
                for app in apps:
                    app.start()
                try:
                    for _ in range(args.trials):
                        _trial(cluster, apps)
                finally:
                    for app in apps:
                        app.stop.set()
                    for app in apps:
                        app.join(30)
                print("indeterminate seen by the apps:", {a.name: a.indeterminate for a in apps})
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
