"""Memory of a slave that falls behind: the reproduction of a `make bench` outlier.

    python -m bench.slow_slave                                  # WRITE_NO_SYNC, 8 MiB
    python -m bench.slow_slave --policy SYNC --rounds 3
    python -m bench.slow_slave --inflight-bytes 1048576         # a 1 MiB replication window
    python -m bench.slow_slave --catch-up 300000                # a restarted slave instead

A fresh three-node cluster (deploy/cluster.example.toml, master_sync = replica_sync =
--policy, acks majority) takes --rounds pipelined loads of --events 100-byte events
(`single_node.pipelined_publish`). During each load one slave is starved the way a
loaded machine starves a process: SIGSTOP for 0.7 s, SIGCONT for 0.3 s, for
--starve-seconds. It then catches up with full-window batches (up to
`replication_inflight_bytes_max` each) while the other slave, up to date, gets the
master's small batches. After each round, once the starved slave holds the master's
log, every replica's RSS and anonymous memory (`/proc/PID/status`) is printed.

--catch-up N instead kills a slave (kill -9), publishes N events, restarts it and
prints the memory once it caught up (`replicated.catch_up`): a fresh process whose only
work was receiving the backlog in full-window batches. What the figures show is in
docs/operations.md ("Memory of a slave that catches up").

A measurement, not a test: it fails only when the cluster cannot start, a publish fails
or the starved slave does not catch up within CATCH_UP_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import squall
from bench import memory, replicated, single_node

POLICIES = ("SYNC", "WRITE_NO_SYNC", "NO_SYNC")

# The starvation pattern: stopped most of each second, as under a load average of 10+.
STOP_S = 0.7
RUN_S = 0.3
CATCH_UP_TIMEOUT_S = 120.0
POLL_S = 0.25
MIB = 1 << 20


def _starve(pid: int, seconds: float, done: threading.Event) -> None:
    """SIGSTOP/SIGCONT pid for `seconds` (or until done); always leaves it running."""
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(STOP_S)
            os.kill(pid, signal.SIGCONT)
            done.wait(RUN_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def _replica_memory(pids: dict[str, int]) -> str:
    parts = []
    for name, figures in memory.sample(pids).items():
        if figures is None:
            parts.append(f"{name} gone")
            continue
        parts.append(
            f"{name} rss {figures['rss_bytes'] / MIB:.0f} "
            f"anon {figures.get('rss_anon_bytes', 0) / MIB:.0f} "
            f"peak {figures['peak_rss_bytes'] / MIB:.0f}"
        )
    return "; ".join(parts) + " (MiB)"


def _wait_caught_up(cluster: replicated._Bench, victim: str) -> None:
    deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
    while time.monotonic() < deadline:
        master = cluster.master()
        slave = cluster.state(victim)
        top = cluster.state(master) if master is not None else None
        if slave is not None and top is not None and slave.last_lsn >= top.last_lsn:
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"replica {victim} did not catch up in {CATCH_UP_TIMEOUT_S:.0f} s")


def run(
    policy: str,
    events: int,
    rounds: int,
    starve_s: float,
    inflight_bytes: int | None,
    catch_up: int = 0,
) -> None:
    """Prints each replica's memory at idle and after every round (or after catch-up)."""
    durability: dict[str, object] = {
        "master_sync": policy,
        "replica_sync": policy,
        "acks": "majority",
    }
    limits: dict[str, object] = {}
    if inflight_bytes is not None:
        limits["replication_inflight_bytes_max"] = inflight_bytes
    with (
        tempfile.TemporaryDirectory(prefix="squall-slow-slave-") as temp,
        replicated.running(Path(temp), durability=durability, limits=limits) as cluster,
    ):
        if catch_up:
            with squall.connect(cluster.gateway_address) as client:
                client.create_topic("bench-catch-up")
            figures = replicated.catch_up(cluster, catch_up, lambda line: None)
            pids = {k: v for k, v in cluster.pids().items() if k.startswith("replica-")}
            print(
                f"caught up {figures['events_behind']:,} events in "
                f"{figures['seconds_from_restart']} s: {_replica_memory(pids)}",
                flush=True,
            )
            return
        master = cluster.settled()
        victim = next(n.id for n in cluster.config.nodes if n.id != master)
        pids = {k: v for k, v in cluster.pids().items() if k.startswith("replica-")}
        victim_pid = pids[f"replica-{victim}"]
        print(f"master {master}, starved slave {victim} (pid {victim_pid})", flush=True)
        print(f"idle: {_replica_memory(pids)}", flush=True)
        topics = [f"slow-slave-{i}" for i in range(rounds)]
        with squall.connect(cluster.gateway_address) as client:
            for topic in topics:
                client.create_topic(topic)
        for i, topic in enumerate(topics):
            done = threading.Event()
            starver = threading.Thread(target=_starve, args=(victim_pid, starve_s, done))
            starver.start()
            try:
                meter = single_node.CpuMeter(cluster.pids())
                result = single_node.pipelined_publish(
                    cluster.gateway_address, topic, events, 120.0, meter
                )
            finally:
                done.set()
                starver.join()
            _wait_caught_up(cluster, victim)
            print(
                f"round {i + 1}: {result['events']:,} events at {result['events_per_s']:,}/s; "
                f"caught up: {_replica_memory(pids)}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="WRITE_NO_SYNC", choices=POLICIES)
    parser.add_argument("--events", type=int, default=200_000, help="events per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--starve-seconds", type=float, default=15.0)
    parser.add_argument(
        "--inflight-bytes",
        type=int,
        default=None,
        help="limits.replication_inflight_bytes_max (default: the template's 8 MiB)",
    )
    parser.add_argument(
        "--catch-up",
        type=int,
        default=0,
        metavar="EVENTS",
        help="restart a slave this many events behind instead of starving one",
    )
    args = parser.parse_args(argv)
    run(
        args.policy,
        args.events,
        args.rounds,
        args.starve_seconds,
        args.inflight_bytes,
        args.catch_up,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
