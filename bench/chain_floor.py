"""The floor of a publish's path: bare gRPC relays in the shape of the cluster, no work.

`bench.latency.floor` measures one round trip between two processes. A publish crosses
more than one: through the gateway, app -> gateway -> master -> both slaves, the first
slave's ack back to the master (a majority of three), master -> gateway -> app; through a
`replicated=True` proxy the same without the gateway. This module starts that chain as
bare relays, one process each, and measures what it carries with nothing done at any hop:
no protobuf, no store, no planning, only gRPC and asyncio as the services run them (a
`grpc.aio` server per process, long-lived bidirectional streams between them, the
services' gRPC I/O path from `squall_server`). Whatever Squall does on top costs more; an
aim the chain itself does not reach is beyond this machine's floor for that path.

Two loads, each measured through both shapes:

* one at a time: one message in flight, sent and awaited by a sync client on one stream
  (the path `squall.Publisher` takes): rate and p50 / p99;
* `callers` asyncio tasks (default 64), each sending one 100-byte event at a time and
  awaiting its answer, their waiting events joined into one message per request with at
  most `window` requests in flight (`squall._publish_join.SHARED_INFLIGHT_MAX`, the
  library's shared stream): aggregate rate, p50 / p99, and each process's CPU per event.

```
.venv/bin/python -m bench.chain_floor              # both shapes, both loads
.venv/bin/python -m bench.chain_floor --json out.json
```

Measurements, not tests: each load is bounded by a count and a deadline, every relay is
stopped by its PID, also when a load fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from bench.idle_cpu import _positive
from bench.single_node import CpuMeter, percentile
from squall._publish_join import SHARED_INFLIGHT_MAX

METHOD = "/chain.Chain/Stream"
EVENT = b"x" * 100
ID_BYTES = 8
SHAPES = ("gateway", "proxy")

# One relay process. Its role comes from its arguments: with downstream addresses it
# forwards each message to all of them and answers upstream once `needed` of them have
# answered (the master: one slave's ack makes a majority of three; the gateway: its one
# master); with none it answers each message at once (a slave's ack). Messages start
# with an 8-byte id that routes the answer; nothing else in them is read.
_RELAY = r"""
import asyncio, collections, sys
import squall_server  # noqa: F401  (the services' gRPC I/O path, set before gRPC loads)
import grpc
from squall_server.common.eager import start_now

METHOD = "/chain.Chain/Stream"


class Writer:
    # gRPC takes one write at a time on a stream end; the rest queue behind it. A write
    # starts in the caller's turn, as the master's sends to its slaves do (start_now), so
    # a message goes to both slaves at once.
    def __init__(self, write):
        self._write, self._pending, self._task = write, collections.deque(), None

    def send(self, message):
        self._pending.append(message)
        if self._task is None:
            self._task = True  # writing: set before the first step runs
            self._task = start_now(self._drain(), name="write")

    async def _drain(self):
        try:
            while self._pending:
                await self._write(self._pending.popleft())
        finally:
            self._task = None


async def main():
    needed, downstream = int(sys.argv[1]), sys.argv[2:]
    waiting = {}  # id -> [upstream writer, answers still needed]
    writers = []

    async def read(call):
        while (message := await call.read()) is not grpc.aio.EOF:
            entry = waiting.get(message[:8])
            if entry is None:
                continue  # an answer past the ones needed (the second slave's ack)
            entry[1] -= 1
            if entry[1] == 0:
                del waiting[message[:8]]
                entry[0].send(message[:8])

    channels = [grpc.aio.insecure_channel(address) for address in downstream]
    readers = []
    for channel in channels:
        call = channel.stream_stream(METHOD)()
        writers.append(Writer(call.write))
        readers.append(asyncio.ensure_future(read(call)))

    async def stream(requests, context):
        upstream = Writer(context.write)
        async for message in requests:
            if not writers:
                upstream.send(message[:8])
                continue
            waiting[message[:8]] = [upstream, needed]
            for writer in writers:
                writer.send(message)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "chain.Chain", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}
    ),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for reader in readers:
        reader.cancel()
    for channel in channels:
        await channel.close()
    await server.stop(1)

asyncio.run(main())
"""


@contextlib.contextmanager
def running(shape: str) -> Iterator[tuple[str, dict[str, int]]]:
    """The relays of `shape` ("gateway" or "proxy"), started slaves first; yields the
    front's address and every relay's PID by role. Each relay is stopped by its PID."""
    if shape not in SHAPES:
        raise ValueError(f"no relay chain of shape {shape!r}: one of {', '.join(SHAPES)}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The relays stand for the services and import squall_server first: their gRPC I/O
    # path (services/__init__.py), or the operator's own GRPC_EXPERIMENTS, as theirs.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    started: list[tuple[str, subprocess.Popen[str]]] = []

    def start(role: str, needed: int, downstream: list[str]) -> str:
        process = subprocess.Popen(
            [sys.executable, "-c", _RELAY, str(needed), *downstream],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append((role, process))
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the {role} relay did not start (printed {line!r})")
        return f"127.0.0.1:{int(line)}"

    try:
        slaves = [start(f"slave-{i}", 0, []) for i in (1, 2)]
        front = start("master", 1, slaves)
        if shape == "gateway":
            front = start("gateway", 1, [front])
        yield front, {role: process.pid for role, process in started}
    finally:
        # Front first: each relay closes its streams downstream before those servers stop.
        for _role, process in reversed(started):
            end_child(process)


def end_child(process: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    """Stops a bench child that serves until its stdin closes (a relay, the floor's echo
    server): closes it and waits, then kills it by its PID past `grace_s`."""
    if process.stdin is not None:
        process.stdin.close()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def one_at_a_time(
    address: str, count: int, deadline_s: float, pids: dict[str, int] | None = None
) -> dict[str, Any]:
    """`count` messages of one event, each awaited before the next, on one stream fed
    from a queue as `squall.Publisher` feeds its own (or fewer past the deadline); with
    `pids`, the CPU per message of this process and each relay."""
    requests: collections.deque[bytes] = collections.deque()
    ready = threading.Semaphore(0)

    def feed() -> Iterator[bytes]:
        while True:
            ready.acquire()
            if not requests:
                return
            yield requests.popleft()

    latencies_s: list[float] = []
    warmup = 50
    with grpc.insecure_channel(address) as channel:
        call: Any = channel.stream_stream(METHOD, None, None)(feed(), timeout=deadline_s + 5)
        stop_at = time.monotonic() + deadline_s
        started = time.perf_counter()
        meter = CpuMeter({"client": os.getpid(), **(pids or {})})
        try:
            for i in range(count + warmup):
                if time.monotonic() > stop_at:
                    break
                if i == warmup:
                    started = time.perf_counter()
                    meter.start()
                t0 = time.perf_counter()
                requests.append(i.to_bytes(ID_BYTES, "big") + EVENT)
                ready.release()
                next(call)
                if i >= warmup:
                    latencies_s.append(time.perf_counter() - t0)
            cpu = meter.stop() if latencies_s else {}
        finally:
            ready.release()  # the feed ends: the stream half-closes
            call.cancel()
        elapsed_s = time.perf_counter() - started
    figures = _figures(latencies_s, elapsed_s)
    if pids is not None:
        _cpu_per_event(figures, cpu, pids)
    return figures


def joined(
    address: str,
    callers: int,
    seconds: float,
    pids: dict[str, int],
    window: int = SHARED_INFLIGHT_MAX,
) -> dict[str, Any]:
    """`callers` asyncio tasks on one stream, each sending one event at a time and
    awaiting its answer; the events waiting when a request slot is free go as one message
    (at most `window` in flight), as the library's shared stream joins them. Counted over
    the last three quarters of `seconds`; CPU per event of this process and each relay."""
    per_caller: list[list[tuple[float, float]]] = [[] for _ in range(callers)]

    async def main() -> tuple[float, float, dict[str, float]]:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(address) as channel:
            call: Any = channel.stream_stream(METHOD, None, None)(None)
            waiting: list[asyncio.Future[None]] = []
            in_flight: dict[bytes, list[asyncio.Future[None]]] = {}
            ids = iter(range(1 << 62))
            writing = False

            async def pump() -> None:
                nonlocal writing
                if writing:
                    return
                writing = True
                try:
                    while waiting and len(in_flight) < window:
                        key = next(ids).to_bytes(ID_BYTES, "big")
                        in_flight[key], waiting[:] = list(waiting), []
                        await call.write(key + EVENT * len(in_flight[key]))
                finally:
                    writing = False

            async def read() -> None:
                while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    for future in in_flight.pop(message[:ID_BYTES]):
                        future.set_result(None)
                    await pump()

            reader = asyncio.ensure_future(read())
            stop_at = time.perf_counter() + seconds

            async def run(index: int) -> None:
                mine = per_caller[index]
                # Bounded by the deadline; each wait by the stream's own.
                while (t0 := time.perf_counter()) < stop_at:
                    future = loop.create_future()
                    waiting.append(future)
                    await pump()
                    await asyncio.wait_for(future, 30)
                    t1 = time.perf_counter()
                    mine.append((t1, t1 - t0))

            tasks = [asyncio.ensure_future(run(i)) for i in range(callers)]
            await asyncio.sleep(seconds / 4)
            counted_from = time.perf_counter()
            meter = CpuMeter({"client": os.getpid(), **pids})
            meter.start()
            await asyncio.gather(*tasks)
            counted_until = time.perf_counter()
            cpu = meter.stop()
            # Not reader.cancel(): cancelling a task in call.read() cancels the call.
            await call.done_writing()
            await asyncio.wait_for(reader, 10)
            return counted_from, counted_until, cpu

    counted_from, counted_until, cpu = asyncio.run(main())
    latencies_s = [s for mine in per_caller for t, s in mine if t >= counted_from]
    figures = _figures(latencies_s, counted_until - counted_from)
    figures["callers"] = callers
    figures["window"] = window
    _cpu_per_event(figures, cpu, pids)
    return figures


def _cpu_per_event(figures: dict[str, Any], cpu: dict[str, float], pids: dict[str, int]) -> None:
    """Adds each process's CPU per event (µs) from a `CpuMeter` reading (% of a core)."""
    rate = figures["events_per_s"]
    per_event = {
        k: round(10_000 * v / rate, 1) if rate else 0.0
        for k, v in cpu.items()
        if k in pids or k == "client"
    }
    figures["cpu_us_per_event"] = per_event
    figures["cpu_us_per_event_total"] = round(sum(per_event.values()), 1)


def _figures(latencies_s: list[float], elapsed_s: float) -> dict[str, Any]:
    latencies_s.sort()
    return {
        "events": len(latencies_s),
        "events_per_s": round(len(latencies_s) / elapsed_s) if elapsed_s > 0 else 0,
        "latency_ms_p50": round(1000 * percentile(latencies_s, 0.5), 3),
        "latency_ms_p99": round(1000 * percentile(latencies_s, 0.99), 3),
    }


def measure(count: int = 2000, callers: int = 64, seconds: float = 4.0) -> dict[str, Any]:
    """Both shapes under both loads: {shape: {"one_at_a_time": ..., "joined": ...}}."""
    out: dict[str, Any] = {}
    for shape in SHAPES:
        with running(shape) as (address, pids):
            out[shape] = {
                "one_at_a_time": one_at_a_time(address, count, 30.0, pids),
                "joined": joined(address, callers, seconds, pids),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.chain_floor", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--count", type=_positive(int), default=2000, help="one-at-a-time messages")
    parser.add_argument("--callers", type=_positive(int), default=64)
    parser.add_argument("--seconds", type=_positive(float), default=4.0, help="per joined load")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    figures = measure(args.count, args.callers, args.seconds)
    figures["load_average"] = [round(x, 2) for x in os.getloadavg()]
    for shape in SHAPES:
        one, many = figures[shape]["one_at_a_time"], figures[shape]["joined"]
        print(
            f"{shape:8} one at a time {one['events_per_s']:>7,}/s p50 {one['latency_ms_p50']} ms"
            f" CPU {one['cpu_us_per_event_total']} µs"
            f" | {many['callers']} callers joined {many['events_per_s']:>7,}/s"
            f" p50 {many['latency_ms_p50']} p99 {many['latency_ms_p99']} ms,"
            f" CPU {many['cpu_us_per_event_total']} µs/event {many['cpu_us_per_event']}"
        )
    print(f"load average {figures['load_average']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
