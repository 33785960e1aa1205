"""CPU an idle cluster burns (issue 16): a three-node cluster that publishes nothing.

Starts deploy/cluster.example.toml localized into a temporary directory (free loopback
ports, default timeouts: heartbeats every 100 ms, merge probes every 200 ms), as
``bench/replicated.py`` does (every replica, the first coordinator, the others and the
gateway), waits until the nodes are one normal group, lets it settle ``--settle`` seconds,
then reads each process's CPU time (``utime + stime`` from ``/proc/PID/stat``: every
thread of it, gRPC's included) at the start and end of a ``--seconds`` window in which
nothing is published. CPU time, not wall clock: other jobs on the machine do not count
against the cluster (the load average at the start and end is printed beside the figures).

Prints CPU % of one core per process and per role (coordinator, replica, gateway: the
median process and the sum), and how often each process's threads woke (their voluntary
context switches, ``/proc/PID/task/*/status``: every wait that ended, on a socket, a
timer or another thread) with the CPU per wake-up; with ``--threads``, each process's
CPU by thread name (``/proc/PID/task/*/comm``; gRPC names its pollers and timer threads).
``--windows N`` measures N windows back to back on the same cluster. ``--json`` prints
the figures as one JSON document instead.

``--floor`` measures, instead of a cluster, what the cluster's idle traffic is made of on
this machine: two processes with the services' gRPC settings (their GRPC_EXPERIMENTS,
services/__init__.py, unless set; their channel options), one serving
``Coordinator.Deliver`` with an empty handler, the other calling it one call at a time at
``--rate`` calls per second (a coordinator's heartbeats and probes arrive so, spread out,
never in bursts): the CPU of one unary call on the calling side and on the serving side,
and the CPU of one bare asyncio timer wake-up (the caller's loop sleeping at the same
rate, no calls). An idle process's CPU is about its calls per second times the first two
plus its timer wake-ups per second times the third (bench/README.md, *Idle CPU*).

``python -m bench.idle_cpu [--seconds S] [--settle S] [--windows N] [--threads]
[--json]``; ``python -m bench.idle_cpu --floor [--seconds S] [--rate N]``. A measurement,
not a test; it fails only when the cluster does not start or settle (or a floor process
does not start). Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from bench import replicated
from deploy import processes
from squall.v1 import coordinator_pb2, coordinator_pb2_grpc
from squall_server import GRPC_EXPERIMENTS_DEFAULT
from squall_server.common.grpc_server import channel_options

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
ROLES = ("coordinator", "replica", "gateway")


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a live process (every thread), in clock ticks; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def thread_ticks(pid: int) -> Counter[str]:
    """CPU ticks per thread name of a live process (threads of one name summed)."""
    found: Counter[str] = Counter()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        fields = text[text.rindex(")") + 2 :].split()
        found[name] += int(fields[11]) + int(fields[12])
    return found


def sleeps(pid: int) -> int:
    """How often the threads of a live process have blocked so far (their voluntary
    context switches: each is a wait that ended in a wake-up); 0 if it is gone."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def measure(
    pids: dict[str, int], seconds: float, threads: bool
) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, float]]]:
    """CPU % of one core per process over one window, its threads' wake-ups per second
    (and CPU % per thread name)."""
    before = {name: cpu_ticks(pid) for name, pid in pids.items()}
    sleeps_before = {name: sleeps(pid) for name, pid in pids.items()}
    threads_before = {name: thread_ticks(pid) for name, pid in pids.items()} if threads else {}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    percent: dict[str, float] = {}
    wakeups: dict[str, float] = {}
    by_thread: dict[str, dict[str, float]] = {}
    for name, pid in pids.items():
        start, end = before[name], cpu_ticks(pid)
        if start is None or end is None:
            raise RuntimeError(f"{name} (pid {pid}) exited during the measurement")
        percent[name] = 100.0 * (end - start) / _TICKS_PER_S / elapsed
        wakeups[name] = (sleeps(pid) - sleeps_before[name]) / elapsed
        if threads:
            delta = thread_ticks(pid)
            delta.subtract(threads_before[name])
            by_thread[name] = {
                thread: 100.0 * ticks / _TICKS_PER_S / elapsed
                for thread, ticks in delta.most_common()
                if ticks > 0
            }
    return percent, wakeups, by_thread


def summary(percent: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per role: the median process and the sum, in % of one core."""
    result = {}
    for role in ROLES:
        values = [v for name, v in percent.items() if name.startswith(f"{role}-")]
        if values:
            result[role] = {"median": statistics.median(values), "sum": sum(values)}
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Starts the cluster, measures its windows, stops it."""
    windows = []
    with tempfile.TemporaryDirectory(prefix="squall-idle-") as temp:
        with replicated.running(Path(temp)) as cluster:
            pids = {name: pid for name, pid in cluster.pids().items() if name != "client"}
            time.sleep(args.settle)
            load_start = os.getloadavg()
            for _ in range(args.windows):
                percent, wakeups, by_thread = measure(pids, args.seconds, args.threads)
                windows.append(
                    {
                        "processes": percent,
                        "wakeups_per_s": wakeups,
                        "roles": summary(percent),
                        "threads": by_thread,
                    }
                )
            load_end = os.getloadavg()
    return {
        "seconds": args.seconds,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "windows": windows,
    }


def text(results: dict[str, Any]) -> str:
    """The figures for people."""
    load = " / ".join(
        f"{results[key][0]:.2f}" for key in ("load_average_start", "load_average_end")
    )
    lines = [f"idle CPU, % of one core over {results['seconds']:.0f} s (load average {load})"]
    for index, window in enumerate(results["windows"], 1):
        lines.append(f"window {index}:")
        for name, value in sorted(window["processes"].items()):
            wakeups = window["wakeups_per_s"][name]
            per_wakeup = 1e4 * value / wakeups if wakeups else 0.0
            lines.append(
                f"  {name:<16} {value:6.2f} %  {wakeups:5.0f} thread wake-ups/s"
                f"  {per_wakeup:5.0f} us CPU per wake-up"
            )
            for thread, share in window["threads"].get(name, {}).items():
                lines.append(f"      {thread:<20} {share:6.2f} %")
        for role, figures in window["roles"].items():
            lines.append(
                f"  {role:<12} median {figures['median']:6.2f} %  sum {figures['sum']:6.2f} %"
            )
    return "\n".join(lines)


# --floor: the message limit the services use by default (deploy/cluster.example.toml).
_MAX_MESSAGE_BYTES = 33_554_432
_FLOOR_WARMUP_CALLS = 20
_FLOOR_START_S = 30.0


async def _deliver(
    request: coordinator_pb2.PeerMessage, context: grpc.aio.ServicerContext[Any, Any]
) -> coordinator_pb2.DeliverResponse:
    """Coordinator.Deliver with nothing behind it."""
    return coordinator_pb2.DeliverResponse()


async def _floor_server(port: int) -> None:
    """Serves Coordinator.Deliver (empty) until stdin closes."""
    server = grpc.aio.server(options=channel_options(_MAX_MESSAGE_BYTES))
    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
    handler = grpc.unary_unary_rpc_method_handler(
        _deliver,
        request_deserializer=coordinator_pb2.PeerMessage.FromString,
        response_serializer=coordinator_pb2.DeliverResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"Deliver": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


async def _floor_client(port: int, rate: float, seconds: float, calls: bool) -> None:
    """Warms up, says "go", then for ``seconds`` makes one call (or none) per 1/rate s."""
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=channel_options(_MAX_MESSAGE_BYTES)
    )
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    message = coordinator_pb2.PeerMessage()
    for _ in range(_FLOOR_WARMUP_CALLS):
        await stub.Deliver(message, timeout=_FLOOR_START_S)
    print("go", flush=True)
    count = int(seconds * rate)
    for _ in range(count):  # bounded: one call per period
        if calls:
            await stub.Deliver(message, timeout=_FLOOR_START_S)
        await asyncio.sleep(1 / rate)
    print(f"done {count}", flush=True)
    await channel.close(None)


def floor(seconds: float, rate: float) -> dict[str, float]:
    """CPU µs and thread wake-ups of one unary call (caller, server) and of one asyncio
    timer wake-up."""
    port = processes.free_port()
    module = [sys.executable, "-m", "bench.idle_cpu"]
    # As a service process runs gRPC (an operator's own value wins there too).
    env = {
        **os.environ,
        "GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT),
    }
    server = subprocess.Popen(
        [*module, "--floor-server", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    result: dict[str, float] = {}
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "serving":
            raise RuntimeError("the floor server did not start")
        for calls in (False, True):
            kind = "--floor-calls" if calls else "--floor-idle"
            client = subprocess.Popen(
                [*module, kind, str(port), str(rate), str(seconds)],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            try:
                assert client.stdout is not None
                if client.stdout.readline().strip() != "go":
                    raise RuntimeError("the floor client did not start")
                before = (cpu_ticks(client.pid), cpu_ticks(server.pid))
                slept = (sleeps(client.pid), sleeps(server.pid))
                done = client.stdout.readline().split()
                after = (cpu_ticks(client.pid), cpu_ticks(server.pid))
                woke = [sleeps(client.pid) - slept[0], sleeps(server.pid) - slept[1]]
                client.wait(_FLOOR_START_S)
            finally:
                # Also when it failed to start or hangs: stopped by its PID.
                processes.stop_pid(client.pid)
                client.wait(_FLOOR_START_S)
            if len(done) != 2 or None in before or None in after:
                raise RuntimeError("a floor process ended early")
            periods = int(done[1])
            client_us, server_us = (
                1e6 * (int(a or 0) - int(b or 0)) / _TICKS_PER_S / periods
                for a, b in zip(after, before, strict=True)
            )
            client_wakeups, server_wakeups = (w / periods for w in woke)
            if calls:
                # The caller's loop woke for its sleeps as in the idle run: not the call's.
                result["call_client_us"] = client_us - result["wakeup_us"]
                result["call_server_us"] = server_us - result["server_idle_us"]
                result["call_client_wakeups"] = client_wakeups - result["wakeup_wakeups"]
                result["call_server_wakeups"] = server_wakeups - result["server_idle_wakeups"]
            else:
                result["wakeup_us"] = client_us
                result["server_idle_us"] = server_us
                result["wakeup_wakeups"] = client_wakeups
                result["server_idle_wakeups"] = server_wakeups
    finally:
        if server.stdin is not None:
            server.stdin.close()
        processes.stop_pid(server.pid)
        server.wait(_FLOOR_START_S)
    return result


def floor_text(figures: dict[str, float], rate: float) -> str:
    """The floor figures for people."""
    return "\n".join(
        [
            f"one call or wake-up every {1000 / rate:.0f} ms, CPU per call / wake-up "
            f"(load average {os.getloadavg()[0]:.2f}):",
            f"  unary call, calling side   {figures['call_client_us']:7.0f} us"
            f"  ({figures['call_client_wakeups']:.1f} thread wake-ups)",
            f"  unary call, serving side   {figures['call_server_us']:7.0f} us"
            f"  ({figures['call_server_wakeups']:.1f} thread wake-ups)",
            f"  asyncio timer wake-up      {figures['wakeup_us']:7.0f} us"
            f"  ({figures['wakeup_wakeups']:.1f} thread wake-ups)",
        ]
    )


def _positive(kind: type[int] | type[float]) -> Any:
    """An argparse type: a number above zero (a window, a rate), else a usage error."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--floor-server":
        asyncio.run(_floor_server(int(argv[1])))
        return 0
    if argv and argv[0] in ("--floor-calls", "--floor-idle"):
        port, rate, seconds = int(argv[1]), float(argv[2]), float(argv[3])
        asyncio.run(_floor_client(port, rate, seconds, argv[0] == "--floor-calls"))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=_positive(float), default=30.0, help="length of one window"
    )
    parser.add_argument(
        "--floor", action="store_true", help="CPU of one bare call and one wake-up instead"
    )
    parser.add_argument(
        "--rate",
        type=_positive(float),
        default=30.0,
        help="--floor: calls (or wake-ups) per second",
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds idle before the first window"
    )
    parser.add_argument("--windows", type=_positive(int), default=1, help="windows back to back")
    parser.add_argument("--threads", action="store_true", help="CPU per thread name too")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.floor:
        figures = floor(args.seconds, args.rate)
        print(json.dumps(figures, indent=2) if args.json else floor_text(figures, args.rate))
        return 0
    results = run(args)
    print(json.dumps(results, indent=2) if args.json else text(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
