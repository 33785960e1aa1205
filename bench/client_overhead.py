"""The threaded client's own cost per lone publish: CPU time and thread switches.

One `publish()` at a time through a `Client`'s shared gateway stream
(`squall._publish_mux`) against the in-memory fake broker of the unit tests
(`tests/unit/test_client.py`) served from a child process, so what this process spends is
the client's alone: its Python code, gRPC's request thread and its channel's poller. Per
publish: CPU time (`time.process_time`, this process), and context switches
(`getrusage`: voluntary ones are the waits, one or more per thread hand-off).
A measurement aid (issue 16, item 2), not a test; alternate it with the code before a
change (`git stash`) and compare medians, since the machine may be shared.

    PYTHONPATH=clients python -m bench.client_overhead --runs 5 --count 2000
    PYTHONPATH=clients python -m bench.client_overhead --stages   # the budget's client rows
    PYTHONPATH=clients python -m bench.client_overhead --threads 16   # concurrent publishers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import squall
from bench.latency import PUBLISH_STAGES
from squall.wire import stages as _stages

_SERVER = r"""
import sys, threading
from tests.unit.test_client import FakeBroker, serve_fake
server, address = serve_fake(FakeBroker())
print(address, flush=True)
sys.stdin.read()
server.stop(grace=None)
"""


@contextlib.contextmanager
def fake_broker() -> Iterator[str]:
    """The fake broker in a child process; yields its address."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        yield child.stdout.readline().strip()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)


def one_run(address: str, count: int, topic: str) -> dict[str, float]:
    """Per lone publish: CPU µs and context switches of this process, and wall µs."""
    with squall.connect(address, timeout_s=10.0) as client:
        client.create_topic(topic)
        publisher = client.topic(topic).publisher(f"{topic}-p")
        for _ in range(50):  # the stream, its threads and the caches warm up
            publisher.publish(b"warm-up")
        before = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(count):
            publisher.publish(b"x" * 100)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_us": round((cpu1 - cpu0) / count * 1e6, 1),
        "wall_us": round((wall1 - wall0) / count * 1e6, 1),
        "voluntary_switches": round((after.ru_nvcsw - before.ru_nvcsw) / count, 2),
        "involuntary_switches": round((after.ru_nivcsw - before.ru_nivcsw) / count, 2),
    }


def threads_run(address: str, count: int, topic: str, threads: int) -> dict[str, float]:
    """`threads` threads, each with a publisher of its own publishing one event at a time
    (`count` in all): per event, CPU µs and switches of this process, and wall µs."""
    with squall.connect(address, timeout_s=10.0) as client:
        client.create_topic(topic)
        publishers = [client.topic(topic).publisher(f"{topic}-{i}") for i in range(threads)]
        for publisher in publishers:
            publisher.publish(b"warm-up")

        def run(publisher: squall.Publisher) -> None:
            for _ in range(count // threads):
                publisher.publish(b"x" * 100)

        workers = [threading.Thread(target=run, args=(p,), daemon=True) for p in publishers]
        before = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(600)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
    done = count // threads * threads
    return {
        "cpu_us": round((cpu1 - cpu0) / done * 1e6, 1),
        "wall_us": round((wall1 - wall0) / done * 1e6, 1),
        "voluntary_switches": round((after.ru_nvcsw - before.ru_nvcsw) / done, 2),
        "involuntary_switches": round((after.ru_nivcsw - before.ru_nivcsw) / done, 2),
    }


def stage_run(address: str, count: int, topic: str) -> dict[str, float]:
    """The client's rows of the latency budget (bench/latency.py, PUBLISH_STAGES) for
    lone publishes against the fake broker: median µs of each."""
    with tempfile.TemporaryDirectory() as directory:
        _stages.configure(directory)
        called: dict[str, int] = {}
        try:
            with squall.connect(address, timeout_s=10.0) as client:
                client.create_topic(topic)
                publisher = client.topic(topic).publisher(f"{topic}-p")
                for _ in range(50):
                    publisher.publish(b"warm-up")
                for _ in range(count):
                    key = _stages.request_key(publisher.publisher_id, publisher.next_sequence)
                    called[key] = time.monotonic_ns()
                    publisher.publish(b"x" * 100)
        finally:
            _stages.configure("")
        at: dict[str, dict[str, int]] = {}
        for path in Path(directory).glob("*.stages"):
            for line in path.read_text(encoding="ascii").splitlines():
                stage, key, value = line.split()
                at.setdefault(key, {}).setdefault(stage, int(value))
    rows: dict[str, list[float]] = {label: [] for label, _, _ in _CLIENT_STAGES}
    for key, called_ns in called.items():
        marks = {"c.call": called_ns, **at.get(key, {})}
        for label, first, last in _CLIENT_STAGES:
            if first in marks and last in marks:
                rows[label].append((marks[last] - marks[first]) / 1000)
    return {label: round(statistics.median(v), 1) for label, v in rows.items() if v}


_CLIENT_STAGES = (
    *(row for row in PUBLISH_STAGES if row[1].startswith("c.") and row[2].startswith("c.")),
    ("fake broker round trip (wire to response read)", "c.wire", "c.resp"),
    ("total: publish() to caller returns", "c.call", "c.return"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--stages", action="store_true", help="the budget's client rows instead")
    parser.add_argument("--threads", type=int, default=0, help="concurrent publishers instead")
    args = parser.parse_args()
    with fake_broker() as address:
        runs = [
            threads_run(address, args.count, f"t{i}", args.threads)
            if args.threads
            else (stage_run if args.stages else one_run)(address, args.count, f"t{i}")
            for i in range(args.runs)
        ]
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print(json.dumps({"runs": runs, "median": medians}))


if __name__ == "__main__":
    main()
