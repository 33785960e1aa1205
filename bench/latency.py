"""Latency of one publish at a time, of concurrent one-at-a-time publishers, of delivery.

Scenarios (measurements, not tests; each bounded by a count and a deadline):

* `floor`: one bare gRPC round trip between two Python processes, measured in the same
  run: a grpc.aio server in a child process (as the services are) answering a sync
  client (as `squall` is), unary and as ping-pong on one bidirectional stream (the
  path `Publisher` takes). Every other figure is read against it.
* `one_at_a_time`: `publish()` in a loop, each call waiting for its receipt, through the
  gateway or a `replicated=True` proxy: rate and p50 / p90 / p99 / max.
* `concurrent`: N threads, each with its own publisher (one client), each publishing one
  event at a time for a fixed time: aggregate rate and p50 / p99 per call.
* `concurrent_aio`: N asyncio tasks on one event loop (one `squall.aio` client), each
  publishing one event at a time for a fixed time, each with its own publisher (through
  the gateway, or a `replicated=True` proxy) or all sharing one: aggregate rate and
  p50 / p99 per call.
* `unary`: a raw-stub app (no `squall` library) calling the unary `Publish` with a
  publisher id and a sequence, one event per call, one at a time and from N threads, each
  with its own publisher id, over one channel: the path the gateway carries over its
  shared publish stream to the master (`squall_server.gateway.shared_publish`).
* `delivery`: a following subscriber through the gateway; one event published at a time;
  from the publish call to the subscriber's iterator yielding it: p50 / p99.
* `delivery_slave`: the same with `read_from="replicas"`: with no other reader open, the
  gateway puts the stream on a slave, which hears of each commit from its master's commit
  notice (docs/consumers.md, "Reads from replicas").
* `push_delivery`: the same to an ordered push subscriber's callback (`PushEndpoint`).
* `budget`: the stage marks (`squall.wire.stages`) of the one-at-a-time run joined across the
  client, the gateway and the three replicas into the median time of each stage of one
  publish and of one delivery, and of the push delivery's legs (`PUSH_STAGES`).

`--only delivery` runs the floor and the delivery scenarios alone (not the slave-served one).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc

import squall
import squall.aio
from bench import aims, chain_floor, machine
from bench.single_node import CpuMeter, payloads, percentile
from squall.wire import stages as _stages

# --- the floor: a bare gRPC round trip between two Python processes

_ECHO_SERVER = r"""
import asyncio, sys
import grpc

async def unary(request, context):
    return request

async def stream(requests, context):
    async for request in requests:
        yield request

async def main():
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("echo.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    })
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)

asyncio.run(main())
"""


def _ping_pong(
    channel: grpc.Channel, payload: bytes, rounds: int, stop_at: float, warmup: int = 50
) -> list[tuple[float, float]]:
    """Round trips on one bidirectional stream of `channel`, one message at a time, fed
    from a queue as `Publisher` feeds its stream: `rounds` after `warmup` uncounted ones,
    or fewer once `time.monotonic()` passes `stop_at`. Each as (finished at, seconds),
    on `time.perf_counter()`."""
    requests: collections.deque[bytes] = collections.deque()
    ready = threading.Semaphore(0)

    def feed() -> Any:
        while True:
            ready.acquire()
            if not requests:
                return
            yield requests.popleft()

    call: Any = channel.stream_stream("/echo.Echo/Stream", None, None)(feed(), timeout=60)
    round_trips: list[tuple[float, float]] = []
    try:
        for i in range(rounds + warmup):
            if time.monotonic() > stop_at:
                break
            t0 = time.perf_counter()
            requests.append(payload)
            ready.release()
            next(call)
            if i >= warmup:
                t1 = time.perf_counter()
                round_trips.append((t1, t1 - t0))
    finally:
        ready.release()  # the iterator ends: the stream half-closes
        call.cancel()
    return round_trips


def _concurrent_floor(
    channel: grpc.Channel, payload: bytes, n: int, seconds: float
) -> dict[str, Any]:
    """N threads, each ping-ponging on a stream of its own over one channel for `seconds`
    (as N publishers of one client would without joining their events): what a Python
    gRPC client and server do together on this machine at that concurrency with no work
    behind the answer. Counted over the last three quarters, once every stream is open."""
    per_thread: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    failures: list[BaseException] = []
    stop_at = time.monotonic() + seconds

    def run(index: int) -> None:
        try:
            per_thread[index] = _ping_pong(channel, payload, 10**9, stop_at, warmup=1)
        except BaseException as exc:  # reported below: a failed floor, not a low one
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    counted_from = started + seconds / 4
    time.sleep(seconds / 4)
    cpu0 = time.process_time()
    for thread in threads:
        thread.join(seconds + 30)
    cpu_s = time.process_time() - cpu0
    counted_until = time.perf_counter()
    if failures:
        raise RuntimeError(f"the {n}-thread floor failed: {failures[0]!r}") from failures[0]
    round_trips_s = sorted(s for mine in per_thread for t, s in mine if t >= counted_from)
    calls = len(round_trips_s)
    window_s = counted_until - counted_from
    return {
        "threads": n,
        "calls_per_s": round(calls / window_s) if window_s > 0 else 0,
        "latency_ms_p50": _ms(percentile(round_trips_s, 0.5)),
        "latency_ms_p99": _ms(percentile(round_trips_s, 0.99)),
        "client_cpu_us_per_call": round(1e6 * cpu_s / calls) if calls else 0,
    }


def floor(
    count: int = 2000,
    concurrency: tuple[int, ...] = (),
    concurrent_s: float = 2.0,
    fsync_dir: Path | None = None,
) -> dict[str, Any]:
    """Bare round trips to an echo server in another process: unary, stream ping-pong,
    and (`concurrency`) that many threads ping-ponging at once; and one small write's
    fsync in `fsync_dir` (where the stores are), what a flushing policy adds per commit."""
    # Both sides on gRPC's defaults, as an app's are: not the I/O path squall_server sets
    # for the services (services/__init__.py), which this process passes on otherwise.
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    server = subprocess.Popen(
        [sys.executable, "-c", _ECHO_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    concurrent_figures: dict[str, Any] = {}
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        payload = b"x" * 100
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            unary = channel.unary_unary("/echo.Echo/Unary", None, None)
            for _ in range(50):
                unary(payload, timeout=5)
            unary_s = []
            for _ in range(count):
                t0 = time.perf_counter()
                unary(payload, timeout=5)
                unary_s.append(time.perf_counter() - t0)
            stream_s = [s for _, s in _ping_pong(channel, payload, count, time.monotonic() + 60)]
            for n in concurrency:
                concurrent_figures[str(n)] = _concurrent_floor(channel, payload, n, concurrent_s)
    finally:
        chain_floor.end_child(server)
    unary_s.sort()
    stream_s.sort()
    figures: dict[str, Any] = {
        "calls": count,
        "unary_ms_p50": _ms(percentile(unary_s, 0.5)),
        "unary_ms_p99": _ms(percentile(unary_s, 0.99)),
        "stream_ms_p50": _ms(percentile(stream_s, 0.5)),
        "stream_ms_p99": _ms(percentile(stream_s, 0.99)),
        "fsync_ms_p50": machine.fsync_ms_p50(fsync_dir or Path(tempfile.gettempdir())),
        "cores": len(os.sched_getaffinity(0)),
    }
    if concurrent_figures:
        figures["concurrent"] = concurrent_figures
    return figures


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)


def _figures(latencies_s: list[float], elapsed_s: float) -> dict[str, Any]:
    latencies_s.sort()
    return {
        "events": len(latencies_s),
        "seconds": round(elapsed_s, 3),
        "events_per_s": round(len(latencies_s) / elapsed_s) if elapsed_s else 0,
        "latency_ms_p50": _ms(percentile(latencies_s, 0.50)),
        "latency_ms_p90": _ms(percentile(latencies_s, 0.90)),
        "latency_ms_p99": _ms(percentile(latencies_s, 0.99)),
        "latency_ms_max": _ms(latencies_s[-1] if latencies_s else 0.0),
    }


# --- publishing


def one_at_a_time(
    address: str,
    topic: str,
    count: int,
    deadline_s: float,
    replicated: bool | None = None,
    called_ns: dict[str, int] | None = None,
) -> dict[str, Any]:
    """publish() in a loop, each waiting for its receipt; with called_ns, each call's start
    (monotonic ns) by its request key, for the budget."""
    latencies_s: list[float] = []
    master = ""
    with (
        squall.connect(address) as client,
        client.topic(topic).publisher(replicated=replicated) as publisher,
    ):
        for _ in range(20):
            master = publisher.publish(b"warm-up").master_id
        stop_at = time.monotonic() + deadline_s
        started = time.perf_counter()
        for payload in payloads(count):
            if time.monotonic() > stop_at:
                break
            if called_ns is not None:
                key = _stages.request_key(publisher.publisher_id, publisher.next_sequence)
                called_ns[key] = time.monotonic_ns()
            t0 = time.perf_counter()
            publisher.publish(payload)
            latencies_s.append(time.perf_counter() - t0)
        elapsed_s = time.perf_counter() - started
    figures = _figures(latencies_s, elapsed_s)
    figures["master"] = master
    return figures


def concurrent(
    address: str,
    topic: str,
    publishers: int,
    seconds: float,
    replicated: bool | None = None,
    pids: dict[str, int] | None = None,
    shared: bool = False,
    one_request_per_call: bool = False,
) -> dict[str, Any]:
    """`publishers` threads, each with its own publisher (or all sharing one), one event at a
    time for `seconds`. With one_request_per_call each call takes the path `publish()` took
    before concurrent callers joined their events (one request per call, waiting for a
    window slot), for a before/after in one run."""
    payload = payloads(1)[0]
    per_thread: list[list[float]] = [[] for _ in range(publishers)]
    errors: list[BaseException] = []
    with squall.connect(address) as client:
        handles = [
            client.topic(topic).publisher(replicated=replicated)
            for _ in range(1 if shared else publishers)
        ]
        try:
            for handle in handles:
                handle.publish(b"warm-up")
            start = threading.Barrier(publishers + 1)
            stop_at = [0.0]

            def run(index: int) -> None:
                publisher, samples = handles[0 if shared else index], per_thread[index]
                start.wait()
                try:
                    # Bounded by the deadline (and each call by the publisher's timeout).
                    while (t0 := time.perf_counter()) < stop_at[0]:
                        if one_request_per_call:
                            publisher._publish_batches([(None, payload, None)], 1)
                        else:
                            publisher.publish(payload)
                        samples.append(time.perf_counter() - t0)
                except BaseException as exc:  # reported after the run
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(publishers)]
            for thread in threads:
                thread.start()
            meter = CpuMeter(pids or {})
            stop_at[0] = time.perf_counter() + seconds
            started = time.perf_counter()
            meter.start()
            start.wait()
            for thread in threads:
                thread.join(seconds + 60)
            elapsed_s = time.perf_counter() - started
            cpu = meter.stop()
        finally:
            for handle in handles:
                handle.close()
    if errors:
        raise RuntimeError(f"{len(errors)} publishers failed, the first: {errors[0]!r}")
    figures = _figures([s for samples in per_thread for s in samples], elapsed_s)
    figures["publishers"] = publishers
    figures["shared_publisher"] = shared
    figures["one_request_per_call"] = one_request_per_call
    # % of one core per process: which one is the bound (the client, the gateway, the master).
    figures["cpu_pct"] = {
        k: v for k, v in cpu.items() if k.startswith(("client", "gateway", "replica", "others"))
    }
    return figures


def concurrent_aio(
    address: str,
    topic: str,
    tasks: int,
    seconds: float,
    pids: dict[str, int] | None = None,
    shared: bool = False,
    replicated: bool | None = None,
) -> dict[str, Any]:
    """`tasks` asyncio tasks on one event loop (one `squall.aio` client), each with its
    own publisher (through the gateway, or a proxy with `replicated`; or all sharing one),
    one event at a time for `seconds`; figures as `concurrent`'s."""
    payload = payloads(1)[0]
    per_task: list[list[float]] = [[] for _ in range(tasks)]

    async def main() -> tuple[float, dict[str, float]]:
        async with squall.aio.connect(address) as client:
            handle = await client.topic(topic)
            handles = [
                await handle.publisher(replicated=replicated) for _ in range(1 if shared else tasks)
            ]
            try:
                for publisher in handles:
                    await publisher.publish(b"warm-up")
                stop_at = time.perf_counter() + seconds

                async def run(index: int) -> None:
                    publisher, samples = handles[0 if shared else index], per_task[index]
                    # Bounded by the deadline (and each call by the publisher's timeout).
                    while (t0 := time.perf_counter()) < stop_at:
                        await publisher.publish(payload)
                        samples.append(time.perf_counter() - t0)

                meter = CpuMeter(pids or {})
                started = time.perf_counter()
                meter.start()
                await asyncio.gather(*(run(i) for i in range(tasks)))
                elapsed_s = time.perf_counter() - started
                return elapsed_s, meter.stop()
            finally:
                for publisher in handles:
                    await publisher.close()

    elapsed_s, cpu = asyncio.run(main())
    figures = _figures([s for samples in per_task for s in samples], elapsed_s)
    figures["publishers"] = tasks
    figures["shared_publisher"] = shared
    figures["replicated"] = replicated
    figures["cpu_pct"] = {
        k: v for k, v in cpu.items() if k.startswith(("client", "gateway", "replica", "others"))
    }
    return figures


def unary(
    address: str,
    topic: str,
    publishers: int,
    seconds: float,
    pids: dict[str, int] | None = None,
    idle_pct: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Raw unary `Publish` calls through the gateway, one event each, from `publishers`
    threads (each its own publisher id and sequences) over one channel, for `seconds`;
    `idle_pct` is what each process burnt idle (`idle_cpu`), kept with the figures."""
    from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2

    payload = payloads(1)[0]
    per_thread: list[list[float]] = [[] for _ in range(publishers)]
    errors: list[BaseException] = []
    run_id = f"{os.getpid()}-{time.monotonic_ns()}"
    with grpc.insecure_channel(address) as channel:
        stub = broker_pb2_grpc.PublisherStub(channel)

        def call(publisher_id: str, sequence: int) -> None:
            stub.Publish(
                broker_pb2.PublishRequest(
                    topic=topic,
                    publisher_id=publisher_id,
                    events=[common_pb2.EventData(payload=payload, sequence=sequence)],
                ),
                timeout=30,
            )

        for index in range(publishers):
            call(f"unary-{run_id}-{index}", 1)  # warm-up
        start = threading.Barrier(publishers + 1)
        stop_at = [0.0]

        def run(index: int) -> None:
            publisher_id, samples = f"unary-{run_id}-{index}", per_thread[index]
            start.wait()
            try:
                # Bounded by the deadline (and each call by its timeout).
                for sequence in range(2, 10_000_000):
                    t0 = time.perf_counter()
                    if t0 >= stop_at[0]:
                        return
                    call(publisher_id, sequence)
                    samples.append(time.perf_counter() - t0)
            except BaseException as exc:  # reported after the run
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(publishers)]
        for thread in threads:
            thread.start()
        meter = CpuMeter(pids or {})
        stop_at[0] = time.perf_counter() + seconds
        started = time.perf_counter()
        meter.start()
        start.wait()
        for thread in threads:
            thread.join(seconds + 60)
        elapsed_s = time.perf_counter() - started
        cpu = meter.stop()
    if errors:
        raise RuntimeError(f"{len(errors)} unary publishers failed, the first: {errors[0]!r}")
    figures = _figures([s for samples in per_thread for s in samples], elapsed_s)
    figures["publishers"] = publishers
    figures["cpu_pct"] = {
        k: v for k, v in cpu.items() if k.startswith(("client", "gateway", "replica", "others"))
    }
    figures["cpu_pct_idle"] = {
        k: v for k, v in (idle_pct or {}).items() if k.startswith(("gateway", "replica"))
    }
    return figures


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """What each process burns with nothing to do (heartbeats, watches), % of a core: taken
    off the per-event CPU, where at a few hundred events/s on a loaded machine it is most
    of the raw figure."""
    meter = CpuMeter(pids)
    meter.start()
    time.sleep(seconds)
    return meter.stop()


def delivery(
    address: str,
    topic: str,
    count: int,
    deadline_s: float,
    read_from: Literal["master", "replicas"] | None = None,
) -> dict[str, Any]:
    """One event published at a time; from the publish call to a following subscriber
    (served where `read_from` says: the gateway's setting, the master by default)."""
    sent_at: dict[int, float] = {}
    latencies_s: list[float] = []
    received = threading.Semaphore(0)
    with squall.connect(address) as client:
        handle = client.topic(topic)
        with handle.publisher() as publisher:
            publisher.publish(b"warm-up")
            subscription = handle.subscribe(start="latest", follow=True, read_from=read_from)

            def read() -> None:
                for message in subscription:
                    at = time.perf_counter()
                    index = int(message.payload[:12]) if message.payload[:1].isdigit() else -1
                    if index in sent_at:
                        latencies_s.append(at - sent_at[index])
                        received.release()

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(0.3)  # the subscription is open before the first timed event
            stop_at = time.monotonic() + deadline_s
            started = time.perf_counter()
            for index, payload in enumerate(payloads(count)):
                if time.monotonic() > stop_at:
                    break
                sent_at[index] = time.perf_counter()
                publisher.publish(payload)
                if not received.acquire(timeout=10):
                    break
            elapsed_s = time.perf_counter() - started
            subscription.close()
    return _figures(latencies_s, elapsed_s)


def push_delivery(address: str, topic: str, count: int, deadline_s: float) -> dict[str, Any]:
    """One event published at a time; from the publish call to a push endpoint's callback
    (an ordered push subscriber, `squall.PushEndpoint` in this process)."""
    sent_at: dict[int, float] = {}
    latencies_s: list[float] = []
    received = threading.Semaphore(0)

    def delivered(batch: squall.PushDelivery) -> None:
        at = time.perf_counter()
        for message in batch.messages:
            index = int(message.payload[:12]) if message.payload[:1].isdigit() else -1
            if index in sent_at:
                latencies_s.append(at - sent_at.pop(index))
                received.release()

    with squall.connect(address) as client, squall.PushEndpoint() as endpoint:
        handle = client.topic(topic)
        handle.subscribe_push("bench-push", endpoint, reliability="ordered", on_delivery=delivered)
        try:
            with handle.publisher() as publisher:
                publisher.publish(b"warm-up")
                stop_at = time.monotonic() + deadline_s
                started = time.perf_counter()
                for index, payload in enumerate(payloads(count)):
                    if time.monotonic() > stop_at:
                        break
                    sent_at[index] = time.perf_counter()
                    publisher.publish(payload)
                    if not received.acquire(timeout=10):
                        break
                elapsed_s = time.perf_counter() - started
        finally:
            handle.unsubscribe_push("bench-push")
    return _figures(latencies_s, elapsed_s)


# --- the budget: stage marks joined across processes

# Publish stages in path order: (label, from mark, to mark); "s.*" marks are the first
# slave's to ack (the one a majority of three counts).
PUBLISH_STAGES = (
    ("client: publish() to request queued", "c.call", "c.queued"),
    ("client: queued to taken by gRPC's request thread", "c.queued", "c.wire"),
    ("client -> gateway (network, gateway read)", "c.wire", "g.in"),
    ("gateway -> master (network, master read)", "g.in", "m.in"),
    ("master: read to commit start (writer wake-up)", "m.in", "m.plan"),
    ("master: plan + store write (fsync after the send, below)", "m.plan", "m.stored"),
    ("master: stored to the batch handed to gRPC", "m.stored", "m.sent"),
    ("master -> slave (network, slave read)", "m.sent", "s.in"),
    ("slave: store write (+ fsync)", "s.in", "s.stored"),
    ("slave: stored to the ack handed to gRPC", "s.stored", "s.ack"),
    (
        "slave -> master (network, ack applied, commit; SYNC: and the master's fsync)",
        "s.ack",
        "m.commit",
    ),
    ("master: commit to response built", "m.commit", "m.resp"),
    ("master -> gateway (network, gateway read)", "m.resp", "g.resp"),
    # (The client's "reader thread" on the shared stream is the waiting caller holding
    # its reader role, squall._publish_mux; the labels stay comparable with old runs.)
    ("gateway -> client (network, client reader thread)", "g.resp", "c.resp"),
    ("client: reader thread to caller returns", "c.resp", "c.return"),
)


@dataclass
class Marks:
    """Stage marks of one process: key -> stage -> the first time (ns), and its links."""

    at: dict[str, dict[str, int]] = field(default_factory=dict)
    links: dict[str, list[str]] = field(default_factory=dict)


def read_marks(directory: Path, roles: dict[int, str]) -> dict[str, Marks]:
    """Stage marks per process role ("client", "gateway", "replica-n1", ...)."""
    marks: dict[str, Marks] = {}
    for path in directory.glob("*.stages"):
        found = marks.setdefault(roles.get(int(path.stem), f"pid-{path.stem}"), Marks())
        with path.open(encoding="ascii") as lines:
            for line in lines:
                stage, key, value = line.split()
                if stage == "=":
                    found.links.setdefault(key, []).append(value)
                    continue
                stages = found.at.setdefault(key, {})
                # A slave's counted ack is its first after the write (NO_SYNC's ack on
                # receipt comes before it; the budget runs WRITE_NO_SYNC and SYNC).
                late_ack = stage == "s.ack" and stages.get(stage, 0) < stages.get("s.stored", 0)
                if stage not in stages or late_ack:
                    stages[stage] = int(value)
    return marks


def _linked(marks: Marks, key: str, prefix: str) -> str:
    return next((v for v in marks.links.get(key, ()) if v.startswith(prefix)), "")


def budget(
    directory: Path, roles: dict[int, str], called_ns: dict[str, int], master: str
) -> dict[str, Any]:
    """Median µs per publish stage over the requests whose every mark was found."""
    marks = read_marks(directory, roles)
    on_master = marks.get(master, Marks())
    slaves = [m for role, m in marks.items() if role.startswith("replica-") and role != master]
    samples: dict[str, list[float]] = collections.defaultdict(list)
    totals: list[float] = []
    # Under SYNC the master's fsync runs while its batch is out to the slaves (beside the
    # chain of stages, not in it): from the write to the flush done.
    flushes: list[float] = []
    for key, called in called_ns.items():
        lsn = _linked(on_master, key, "lsn/")
        if not lsn:
            continue
        at: dict[str, int] = {"c.call": called}
        for role in ("client", "gateway", master):
            at.update(marks.get(role, Marks()).at.get(key, {}))
        at.update(on_master.at.get(lsn, {}))
        acked = [s.at[lsn] for s in slaves if "s.ack" in s.at.get(lsn, {})]
        if acked:
            at.update(min(acked, key=lambda m: m["s.ack"]))
        if any(not at.get(mark) for _, first, last in PUBLISH_STAGES for mark in (first, last)):
            continue
        for label, first, last in PUBLISH_STAGES:
            samples[label].append((at[last] - at[first]) / 1000)
        totals.append((at["c.return"] - at["c.call"]) / 1000)
        if at.get("m.synced"):
            flushes.append((at["m.synced"] - at["m.stored"]) / 1000)
    rows: list[dict[str, Any]] = [
        {"stage": label, "us_p50": round(statistics.median(samples[label]), 1)}
        for label, _, _ in PUBLISH_STAGES
        if samples[label]
    ]
    return {
        "requests": len(totals),
        "stages": rows,
        "total_us_p50": round(statistics.median(totals), 1) if totals else 0.0,
        "sum_of_stage_p50s_us": round(sum(r["us_p50"] for r in rows), 1),
        "master_fsync_us_p50": round(statistics.median(flushes), 1) if flushes else 0.0,
    }


# Push delivery legs in path order, as `delivery_budget` joins them: (label, from mark,
# to mark, where the to mark is taken); "e.*" marks are the endpoint's (this process).
PUSH_STAGES = (
    ("master -> endpoint handler (both sides' gRPC, the network)", "p.out", "e.in", "client"),
    ("endpoint: handler to the callback (the app's view built)", "e.in", "e.cb", "client"),
    ("callback, then endpoint -> master (the answer back)", "e.cb", "p.ack", "master"),
)
# A following subscriber's delivery through the gateway, by the first event's offset: the
# replica's "d.out" as its Subscribe handler yields, the gateway's "g.d" as it has read
# it from the replica, the client's "c.d" as the subscription has read it from gRPC.
SUBSCRIBE_STAGES = (
    ("master -> gateway (network, gateway read)", "d.out", "g.d", "gateway"),
    ("gateway -> subscriber (network, the subscription's read)", "g.d", "c.d", "client"),
)


def delivery_budget(
    directory: Path, roles: dict[int, str], master: str, topics: tuple[str, ...]
) -> dict[str, Any]:
    """Median µs from a publish's commit to the master's Subscribe handler sending it, to
    its Deliver call, and the push delivery's legs (`PUSH_STAGES`), over the publishes to
    `topics` (the delivery scenarios'): a topic published earlier and read back later (the
    suite's consume phase) would join its commits to reads a minute later."""
    marks = read_marks(directory, roles)
    wanted = tuple(f"off/{topic}/" for topic in topics)
    if not master:  # the replica that marked deliveries
        master = next((r for r, m in marks.items() if any("p.out" in a for a in m.at.values())), "")
    on_master = marks.get(master, Marks())
    on_client = marks.get("client", Marks())
    on_gateway = marks.get("gateway", Marks())
    waits: list[float] = []
    pushes: list[float] = []
    after_answer: list[float] = []
    legs: dict[str, list[float]] = {
        label: [] for label, _, _, _ in (*PUSH_STAGES, *SUBSCRIBE_STAGES)
    }
    for key in on_master.links:
        offset = _linked(on_master, key, "off/")
        if not offset.startswith(wanted):
            continue
        committed = on_master.at.get(_linked(on_master, key, "lsn/"), {}).get("m.commit")
        at = on_master.at.get(offset, {})
        if committed and at.get("d.out"):
            waits.append((at["d.out"] - committed) / 1000)
        if committed and at.get("p.out"):
            pushes.append((at["p.out"] - committed) / 1000)
        where = {
            "master": at,
            "client": on_client.at.get(offset, {}),
            "gateway": on_gateway.at.get(offset, {}),
        }
        for label, first, last, side in (*PUSH_STAGES, *SUBSCRIBE_STAGES):
            begun = next((w[first] for w in where.values() if first in w), None)
            if begun and where[side].get(last):
                legs[label].append((where[side][last] - begun) / 1000)
        answered = on_client.at.get(key, {}).get("c.resp")
        if answered and where["client"].get("c.d"):
            after_answer.append((where["client"]["c.d"] - answered) / 1000)
    return {
        "events": len(waits),
        "commit_to_sent_us_p50": round(statistics.median(waits), 1) if waits else 0.0,
        "subscribe_stages": [
            {"stage": label, "us_p50": round(statistics.median(legs[label]), 1)}
            for label, _, _, _ in SUBSCRIBE_STAGES
            if legs[label]
        ],
        # The client read the delivery this long after the publish's own answer.
        "delivery_after_answer_us_p50": (
            round(statistics.median(after_answer), 1) if after_answer else None
        ),
        "push_events": len(pushes),
        "commit_to_push_call_us_p50": round(statistics.median(pushes), 1) if pushes else 0.0,
        "push_stages": [
            {"stage": label, "us_p50": round(statistics.median(legs[label]), 1)}
            for label, _, _, _ in PUSH_STAGES
            if legs[label]
        ],
    }


def stage_dir(run_dir: Path) -> Path:
    """Where this run's processes write their stage marks (created empty)."""
    directory = run_dir / "stages"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def stage_marks(directory: Path | None) -> Iterator[None]:
    """Stage marks on (into directory) for this process and every process started meanwhile;
    as they were afterwards. None: leaves them as they are."""
    if directory is None:
        yield
        return
    key = "SQUALL_STAGE_TIMINGS_DIR"
    before = os.environ.get(key)
    os.environ[key] = str(directory)
    _stages.configure(str(directory))
    try:
        yield
    finally:
        _stages.configure(before or "")
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


# --- one policy's latency figures on a running cluster, and the standalone entry point


@dataclass(frozen=True)
class Sizes:
    """How much each latency scenario does."""

    one_at_a_time_events: int = 2000
    one_at_a_time_deadline_s: float = 15.0
    concurrent_s: float = 4.0
    concurrency: tuple[int, ...] = (1, 16, 64)
    delivery_events: int = 500
    delivery_deadline_s: float = 10.0
    floor_calls: int = 2000
    # How long the cluster's idle CPU is measured before the raw unary runs.
    idle_s: float = 2.0
    # How long each concurrent floor (bare round trips from N threads at once) runs.
    floor_concurrent_s: float = 2.0
    # The bare relay chain of the publish's path (bench/chain_floor.py): one-at-a-time
    # messages, and seconds of its most concurrent load (0 leaves the chain out).
    chain_calls: int = 2000
    chain_s: float = 4.0

    @classmethod
    def tiny(cls) -> Sizes:
        """The smoke run's sizes (a few seconds per policy)."""
        return cls(30, 5.0, 0.5, (1, 16), 20, 5.0, 200, 0.2, 0.3, 100, 0.5)


def roles_of(pids: dict[str, int]) -> dict[int, str]:
    """Process id -> the role the budget names ("client", "gateway", "replica-n1")."""
    roles = {}
    for name, pid in pids.items():
        roles[pid] = "gateway" if name.startswith("gateway") else name
    return roles


def measure(
    address: str,
    pids: dict[str, int],
    stages: Path | None,
    sizes: Sizes,
    topic_prefix: str,
    log: Any,
    only: tuple[str, ...] = (),
    data_dir: Path | None = None,
) -> dict[str, Any]:
    """Every latency scenario on one running cluster (stage marks on when `stages` is set);
    with `only`, just those groups ("unary", "library") after the floor. `data_dir` is
    where the cluster's stores are: the floor's fsync is measured there."""
    with squall.connect(address) as client:
        for suffix in (
            "one",
            "proxy",
            "delivery",
            "slave-delivery",
            "push",
            "unary",
            *(f"c{n}" for n in sizes.concurrency),
        ):
            for path in ("", "-proxy"):
                client.create_topic(f"{topic_prefix}-{suffix}{path}")
    out: dict[str, Any] = {}
    log(f"    latency: bare gRPC floor, {sizes.floor_calls} calls, then from threads at once")
    out["floor"] = floor(
        sizes.floor_calls,
        tuple(n for n in sizes.concurrency if n > 1),
        sizes.floor_concurrent_s,
        data_dir,
    )
    if sizes.chain_s > 0:
        callers = max(sizes.concurrency)
        log(f"    latency: bare relay chain of the path, one at a time and {callers} callers")
        out["floor"]["chain"] = chain_floor.measure(sizes.chain_calls, callers, sizes.chain_s)
    if not only or "unary" in only:
        out["unary"] = {}
        idle = idle_cpu(pids, sizes.idle_s)
        for n in sizes.concurrency:
            log(f"    latency: {n} raw unary Publish callers, {sizes.concurrent_s} s")
            out["unary"][str(n)] = unary(
                address, f"{topic_prefix}-unary", n, sizes.concurrent_s, pids=pids, idle_pct=idle
            )
    if only and "delivery" in only:
        _deliveries(address, stages, pids, sizes, topic_prefix, log, out, master="")
    if only and "library" not in only:
        return out
    called_ns: dict[str, int] = {}
    log(f"    latency: one at a time, {sizes.one_at_a_time_events} through the gateway")
    out["one_at_a_time"] = one_at_a_time(
        address,
        f"{topic_prefix}-one",
        sizes.one_at_a_time_events,
        sizes.one_at_a_time_deadline_s,
        called_ns=called_ns if stages else None,
    )
    if stages is not None:
        _stages.flush()
        time.sleep(0.5)  # every service writes its marks 0.2 s after its last
        out["budget"] = budget(stages, roles_of(pids), called_ns, _master_role(out))
    log("    latency: one at a time through a replicated=True proxy")
    out["one_at_a_time_proxy"] = one_at_a_time(
        address,
        f"{topic_prefix}-proxy",
        sizes.one_at_a_time_events,
        sizes.one_at_a_time_deadline_s,
        replicated=True,
    )
    out["concurrent"] = {}
    out["concurrent_proxy"] = {}
    for n in sizes.concurrency:
        log(f"    latency: {n} concurrent one-at-a-time publishers, {sizes.concurrent_s} s")
        out["concurrent"][str(n)] = concurrent(
            address, f"{topic_prefix}-c{n}", n, sizes.concurrent_s, pids=pids
        )
        out["concurrent_proxy"][str(n)] = concurrent(
            address, f"{topic_prefix}-c{n}-proxy", n, sizes.concurrent_s, replicated=True, pids=pids
        )
    out["concurrent_shared"] = {}
    for n in sizes.concurrency[1:]:
        log(f"    latency: {n} threads sharing one publisher, {sizes.concurrent_s} s")
        out["concurrent_shared"][str(n)] = concurrent(
            address, f"{topic_prefix}-c{n}", n, sizes.concurrent_s, pids=pids, shared=True
        )
        out.setdefault("concurrent_shared_one_request_per_call", {})[str(n)] = concurrent(
            address,
            f"{topic_prefix}-c{n}",
            n,
            sizes.concurrent_s,
            pids=pids,
            shared=True,
            one_request_per_call=True,
        )
    out["concurrent_aio"] = {}
    out["concurrent_aio_proxy"] = {}
    out["concurrent_aio_shared"] = {}
    for n in sizes.concurrency[1:]:
        log(
            f"    latency: {n} asyncio tasks, own publishers / own replicated proxies / one "
            f"shared publisher, {sizes.concurrent_s} s"
        )
        out["concurrent_aio"][str(n)] = concurrent_aio(
            address, f"{topic_prefix}-c{n}", n, sizes.concurrent_s, pids=pids
        )
        out["concurrent_aio_proxy"][str(n)] = concurrent_aio(
            address, f"{topic_prefix}-c{n}-proxy", n, sizes.concurrent_s, pids=pids, replicated=True
        )
        out["concurrent_aio_shared"][str(n)] = concurrent_aio(
            address, f"{topic_prefix}-c{n}", n, sizes.concurrent_s, pids=pids, shared=True
        )
    _deliveries(address, stages, pids, sizes, topic_prefix, log, out, _master_role(out))
    # After the delivery budget, which joins the marks of the master-served stream.
    log(f"    latency: publish -> following subscriber on a slave, {sizes.delivery_events} events")
    out["delivery_slave"] = delivery(
        address,
        f"{topic_prefix}-slave-delivery",
        sizes.delivery_events,
        sizes.delivery_deadline_s,
        read_from="replicas",
    )
    return out


def _deliveries(
    address: str,
    stages: Path | None,
    pids: dict[str, int],
    sizes: Sizes,
    topic_prefix: str,
    log: Any,
    out: dict[str, Any],
    master: str,
) -> None:
    """Publish -> following subscriber and -> push endpoint, and their budget (master: its
    role, or "" for the replica that marked the deliveries)."""
    following, pushed = f"{topic_prefix}-delivery", f"{topic_prefix}-push"
    log(f"    latency: publish -> following subscriber, {sizes.delivery_events} events")
    out["delivery"] = delivery(address, following, sizes.delivery_events, sizes.delivery_deadline_s)
    log(f"    latency: publish -> push endpoint, {sizes.delivery_events} events")
    out["push_delivery"] = push_delivery(
        address, pushed, sizes.delivery_events, sizes.delivery_deadline_s
    )
    if stages is not None:
        _stages.flush()  # the endpoint's marks, taken in this process
        time.sleep(0.5)
        out["delivery_budget"] = delivery_budget(
            stages, roles_of(pids), master, (following, pushed)
        )


def _master_of(figures: dict[str, Any]) -> str:
    """The master's node id (the busiest replica when the library scenarios did not run)."""
    if "one_at_a_time" in figures:
        return str(figures["one_at_a_time"]["master"])
    runs: list[dict[str, Any]] = list(figures.get("unary", {}).values())
    cpu: dict[str, float] = runs[0].get("cpu_pct", {}) if runs else {}
    replicas = {k: v for k, v in cpu.items() if k.startswith("replica-")}
    return max(replicas, key=replicas.__getitem__).removeprefix("replica-") if replicas else ""


def _master_role(figures: dict[str, Any]) -> str:
    return f"replica-{figures['one_at_a_time']['master']}"


def _chain_rows(row: Callable[[str, Any], None]) -> None:
    """The bare relay chain's rows (bench/chain_floor.py): per path, one at a time and its
    most concurrent load, with that load's CPU per event over the chain's processes."""
    for shape, path in (
        ("gateway", "app -> gateway -> master -> slaves"),
        ("proxy", "app -> master -> slaves"),
    ):
        row(
            f"floor: bare relay chain {path}, one at a time: events/s, p50 / p99 ms",
            lambda f, shape=shape: (
                f"{f['floor']['chain'][shape]['one_at_a_time']['events_per_s']:,}, "
                f"{f['floor']['chain'][shape]['one_at_a_time']['latency_ms_p50']} / "
                f"{f['floor']['chain'][shape]['one_at_a_time']['latency_ms_p99']}"
            ),
        )
        row(
            f"floor: bare relay chain {path}, callers joined: callers, events/s, p50 / p99 ms, "
            "CPU µs per event",
            lambda f, shape=shape: (
                f"{f['floor']['chain'][shape]['joined']['callers']}, "
                f"{f['floor']['chain'][shape]['joined']['events_per_s']:,}, "
                f"{f['floor']['chain'][shape]['joined']['latency_ms_p50']} / "
                f"{f['floor']['chain'][shape]['joined']['latency_ms_p99']}, "
                f"{f['floor']['chain'][shape]['joined']['cpu_us_per_event_total']}"
            ),
        )


def table(policy_figures: dict[str, dict[str, Any]]) -> str:
    """Markdown: the latency figures and the budget per policy, against the floor."""
    policies = list(policy_figures)
    lines = [
        "| latency, 100-byte events, 3 nodes | " + " | ".join(policies) + " |",
        "|---|" + "---:|" * len(policies),
    ]

    def row(label: str, cell: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(policy_figures[p]) for p in policies) + " |")

    row(
        "floor: bare gRPC round trip, unary / stream p50 ms",
        lambda f: f"{f['floor']['unary_ms_p50']} / {f['floor']['stream_ms_p50']}",
    )
    for n in next(iter(policy_figures.values()))["floor"].get("concurrent", {}):
        row(
            f"floor: {n} threads, each ping-ponging on a stream of its own: calls/s, p50 / p99 ms",
            lambda f, n=n: (
                f"{f['floor']['concurrent'][n]['calls_per_s']:,}, "
                f"{f['floor']['concurrent'][n]['latency_ms_p50']} / "
                f"{f['floor']['concurrent'][n]['latency_ms_p99']}"
            ),
        )
    row(
        "floor: write and fsync 4 KiB where the stores are, p50 ms",
        lambda f: str(f["floor"].get("fsync_ms_p50") or "-"),
    )
    if all("chain" in f["floor"] for f in policy_figures.values()):
        _chain_rows(row)

    for n in next(iter(policy_figures.values())).get("unary", {}):
        row(
            f"{n} raw unary Publish callers (one event a call), gateway: events/s, p50 / p99 ms",
            lambda f, n=n: (
                f"{f['unary'][n]['events_per_s']:,}, {f['unary'][n]['latency_ms_p50']} / "
                f"{f['unary'][n]['latency_ms_p99']}"
            ),
        )
        row(
            f"CPU µs per event, {n} raw unary callers: client / gateway / master (above idle)",
            lambda f, n=n: _cpu_per_event(f["unary"][n], _master_of(f), idle=True),
        )
    if not all("one_at_a_time" in f for f in policy_figures.values()):
        if all("delivery" in f for f in policy_figures.values()):
            _delivery_rows(policy_figures, row)
        return "\n".join(lines + aims.table(policy_figures))

    def rate(fig: dict[str, Any]) -> str:
        return (
            f"{fig['events_per_s']:,}/s, p50 {fig['latency_ms_p50']} / p90 {fig['latency_ms_p90']}"
            f" / p99 {fig['latency_ms_p99']} / max {fig['latency_ms_max']} ms"
        )

    row("one at a time, gateway", lambda f: rate(f["one_at_a_time"]))
    row(
        "one at a time, gateway: p50 / floor (stream)",
        lambda f: (
            f"{f['one_at_a_time']['latency_ms_p50'] / max(f['floor']['stream_ms_p50'], 1e-9):.1f}x"
        ),
    )
    row("one at a time, replicated proxy", lambda f: rate(f["one_at_a_time_proxy"]))
    for n in next(iter(policy_figures.values()))["concurrent"]:
        for path, name in (
            ("concurrent", "gateway"),
            ("concurrent_proxy", "proxy"),
            ("concurrent_shared_one_request_per_call", "gateway, one shared publisher, before"),
            ("concurrent_shared", "gateway, one shared publisher"),
            ("concurrent_aio", "asyncio tasks with own publishers, gateway"),
            ("concurrent_aio_proxy", "asyncio tasks with own replicated proxies"),
            ("concurrent_aio_shared", "asyncio tasks, gateway, one shared publisher"),
        ):
            if n not in next(iter(policy_figures.values())).get(path, {}):
                continue
            row(
                f"{n} concurrent publishers, {name}: events/s, p50 / p99 ms",
                lambda f, n=n, path=path: (
                    f"{f[path][n]['events_per_s']:,}, {f[path][n]['latency_ms_p50']} / "
                    f"{f[path][n]['latency_ms_p99']}"
                ),
            )
    last = list(next(iter(policy_figures.values()))["concurrent"])[-1]
    for path, name in (
        ("concurrent", "own publishers"),
        ("concurrent_shared", "one shared"),
        ("concurrent_aio", "asyncio tasks, own publishers"),
        ("concurrent_aio_proxy", "asyncio tasks, own replicated proxies"),
        ("concurrent_aio_shared", "asyncio tasks, one shared"),
    ):
        if last not in next(iter(policy_figures.values())).get(path, {}):
            continue
        row(
            f"CPU µs per event at {last} publishers ({name}): client / gateway / master",
            lambda f, path=path: _cpu_per_event(f[path][last], f["one_at_a_time"]["master"]),
        )
    _delivery_rows(policy_figures, row)
    lines += aims.table(policy_figures)
    if all("budget" in f for f in policy_figures.values()):
        lines += [
            "",
            "Where one publish goes (median per stage, µs; one-at-a-time through the "
            "gateway; stage marks, `squall.wire.stages`):",
            "",
        ]
        lines.append("| stage | " + " | ".join(policies) + " |")
        lines.append("|---|" + "---:|" * len(policies))
        labels = [label for label, _, _ in PUBLISH_STAGES]
        for label in labels:
            cells = []
            for p in policies:
                found = {r["stage"]: r["us_p50"] for r in policy_figures[p]["budget"]["stages"]}
                cells.append(str(found.get(label, "-")))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append(
            "| sum of the stage medians | "
            + " | ".join(str(policy_figures[p]["budget"]["sum_of_stage_p50s_us"]) for p in policies)
            + " |"
        )
        lines.append(
            "| master: its fsync, beside the stages from the write on (SYNC) | "
            + " | ".join(
                str(policy_figures[p]["budget"].get("master_fsync_us_p50", "-")) for p in policies
            )
            + " |"
        )
        lines.append(
            "| median whole publish (marked calls) | "
            + " | ".join(str(policy_figures[p]["budget"]["total_us_p50"]) for p in policies)
            + " |"
        )
        lines.append(
            "| delivery: commit to the master's Subscribe sending it | "
            + " | ".join(
                str(policy_figures[p].get("delivery_budget", {}).get("commit_to_sent_us_p50", "-"))
                for p in policies
            )
            + " |"
        )
        lines.append(
            "| push: commit to the master's Deliver call | "
            + " | ".join(
                str(
                    policy_figures[p]
                    .get("delivery_budget", {})
                    .get("commit_to_push_call_us_p50", "-")
                )
                for p in policies
            )
            + " |"
        )
    return "\n".join(lines)


def _delivery_rows(
    policy_figures: dict[str, dict[str, Any]], row: Callable[[str, Any], None]
) -> None:
    """The table's delivery rows: latency, then each delivery's legs when marked."""
    row(
        "publish -> following subscriber, p50 / p99 ms",
        lambda f: f"{f['delivery']['latency_ms_p50']} / {f['delivery']['latency_ms_p99']}",
    )
    budgets = [f.get("delivery_budget", {}) for f in policy_figures.values()]
    if all(b.get("subscribe_stages") for b in budgets):
        row(
            "subscriber: commit to the master's Subscribe sending it, µs",
            lambda f: str(f["delivery_budget"]["commit_to_sent_us_p50"]),
        )
        _leg_rows(row, "subscriber", "subscribe_stages", SUBSCRIBE_STAGES)
        row(
            "subscriber: read by the client after the publish's own answer, µs",
            lambda f: str(f["delivery_budget"].get("delivery_after_answer_us_p50", "-")),
        )
    if all("delivery_slave" in f for f in policy_figures.values()):
        row(
            "publish -> following subscriber on a slave (read_from replicas), p50 / p99 ms",
            lambda f: (
                f"{f['delivery_slave']['latency_ms_p50']} / {f['delivery_slave']['latency_ms_p99']}"
            ),
        )
    if all("push_delivery" in f for f in policy_figures.values()):
        row(
            "publish -> push endpoint (ordered), p50 / p99 ms",
            lambda f: (
                f"{f['push_delivery']['latency_ms_p50']} / {f['push_delivery']['latency_ms_p99']}"
            ),
        )
    if all(b.get("push_stages") for b in budgets):
        row(
            "push: commit to the master's Deliver call, µs",
            lambda f: str(f["delivery_budget"]["commit_to_push_call_us_p50"]),
        )
        _leg_rows(row, "push", "push_stages", PUSH_STAGES)


def _leg_rows(
    row: Callable[[str, Any], None],
    name: str,
    key: str,
    stages: tuple[tuple[str, str, str, str], ...],
) -> None:
    """One row per leg of a delivery (`stages`), from the budget's `key` list."""
    for label, _, _, _ in stages:
        row(
            f"{name}: {label}, µs",
            lambda f, label=label: str(
                {r["stage"]: r["us_p50"] for r in f["delivery_budget"][key]}.get(label, "-")
            ),
        )


def _cpu_per_event(figures: dict[str, Any], master: str, idle: bool = False) -> str:
    """CPU time per acknowledged event of the client, the gateway and the master, in µs
    (with `idle`, less what the gateway and the master used idle just before)."""
    rate = max(figures["events_per_s"], 1)
    cpu = figures.get("cpu_pct", {})
    before = figures.get("cpu_pct_idle", {}) if idle else {}
    gateway = sum(v - before.get(k, 0.0) for k, v in cpu.items() if k.startswith("gateway"))
    key = f"replica-{master}"
    cells = (cpu.get("client", 0.0), gateway, cpu.get(key, 0.0) - before.get(key, 0.0))
    return " / ".join(f"{10_000 * pct / rate:.0f}" for pct in cells)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.latency`: the latency scenarios alone, one cluster per policy."""
    import argparse
    import json
    import tempfile

    from bench import replicated

    parser = argparse.ArgumentParser(prog="bench.latency", description=__doc__)
    parser.add_argument("--policy", action="append", choices=("SYNC", "WRITE_NO_SYNC", "NO_SYNC"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--no-stages", action="store_true", help="run without stage marks")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--only",
        action="append",
        choices=("unary", "library", "delivery"),
        help="just these scenario groups after the floor (repeatable; default all)",
    )
    args = parser.parse_args(argv)
    sizes = Sizes.tiny() if args.tiny else Sizes()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"load average at start: {os.getloadavg()}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="squall-latency-") as temp:
        for policy in args.policy or ["WRITE_NO_SYNC", "SYNC"]:
            run_dir = Path(temp) / policy
            stages = None if args.no_stages else stage_dir(run_dir)
            durability = {"master_sync": policy, "replica_sync": policy, "acks": "majority"}
            with (
                stage_marks(stages),
                replicated.running(run_dir, durability=dict(durability)) as cluster,
            ):
                log(f"  {policy}")
                results[policy] = measure(
                    cluster.gateway_address,
                    cluster.pids(),
                    stages,
                    sizes,
                    "lat",
                    log,
                    tuple(args.only or ()),
                    data_dir=run_dir,
                )
    log(f"load average at end: {os.getloadavg()}")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
