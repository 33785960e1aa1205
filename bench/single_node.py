"""Single-node scenarios: a real replica and gateway, driven by the client library.

Each sync policy gets a fresh one-node cluster (deploy/single.toml localized into a
temporary directory with free ports and a [durability] override), started through
`deploy.processes` and stopped by PID whatever happens. The scenarios, all with
100-byte events:

* unary: `publisher.publish` in a loop, one event per round trip, timing each call
  (rate, p50, p99, max);
* pipelined: `publish_many` in batches of 500, as fast as the in-flight window allows;
* subscribe: a non-follow subscription reading, message by message, a topic the
  pipelined scenario filled;
* direct: the pipelined and subscribe runs again straight to the replica's address,
  alternating with the runs through the gateway, to price the gateway hop.

Every measured run also records how much CPU each process (client, gateway, replica,
everything else) used while it ran: on a small machine that is what bounds a figure.
Every loop has a count and a deadline; a run that hits its deadline reports what it
did so far and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import squall
import squall.aio
from deploy import processes
from deploy.launcher import NODE_SERVICES

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deploy" / "single.toml"

EVENT_BYTES = 100
BATCH_EVENTS = 500
# publish_many is called in chunks this big so the deadline is checked between them.
CHUNK_EVENTS = 20_000
# The subscriber checks its deadline once per this many messages.
SUBSCRIBE_CHECK_EVENTS = 10_000
WARMUP_EVENTS = 5_000
# How long past its deadline a stalled subscription is left before it is closed.
STALL_GRACE_S = 10.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1

POLICIES = ("WRITE_NO_SYNC", "SYNC")
SCENARIOS = ("unary", "pipelined", "subscribe", "direct")


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does, and its deadline."""

    unary_events: int
    unary_deadline_s: float
    pipelined_events: int
    pipelined_deadline_s: float
    subscribe_deadline_s: float
    repeats: int

    @classmethod
    def full(cls) -> Sizes:
        """The full run: a few minutes for both policies."""
        return cls(5_000, 20.0, 200_000, 30.0, 15.0, 3)

    @classmethod
    def quick(cls) -> Sizes:
        """A smoke run: well under a minute for both policies."""
        return cls(1_000, 4.0, 50_000, 8.0, 5.0, 1)


@dataclass
class BenchCluster:
    """A running one-node cluster: its node's services and its gateway, by kind."""

    run_dir: Path
    config_path: Path
    services: dict[str, processes.Service]

    @property
    def gateway(self) -> processes.Service:
        """The gateway process."""
        return self.services["gateway"]

    @property
    def replica(self) -> processes.Service:
        """The replica process."""
        return self.services["replica"]

    @property
    def pids(self) -> dict[str, int]:
        """Process ids by role, the client being this process."""
        return {"client": os.getpid(), **{kind: s.pid for kind, s in self.services.items()}}


def write_config(run_dir: Path, master_sync: str) -> Path:
    """deploy/single.toml with free ports, data under run_dir and the given master_sync."""
    document: dict[str, Any] = tomllib.loads(TEMPLATE.read_text())
    document.setdefault("durability", {})["master_sync"] = master_sync
    run_dir.mkdir(parents=True, exist_ok=True)
    source = run_dir / "template.toml"
    source.write_text(processes.dump_toml(document))
    return processes.localize_config(source, run_dir)


@contextlib.contextmanager
def running_cluster(run_dir: Path, master_sync: str) -> Iterator[BenchCluster]:
    """Starts the node's services as `make run` does, then the gateway; stops all by PID."""
    config_path = write_config(run_dir, master_sync)
    document = tomllib.loads(config_path.read_text())
    node, gateway = document["nodes"][0], document["gateways"][0]
    logs = run_dir / "logs"
    # The launcher's list, so the bench starts what `make run` starts as services are added.
    starts = [
        (kind, node["id"], node["replica_address" if kind == "replica" else "coordinator_address"])
        for kind in NODE_SERVICES
    ]
    starts.append(("gateway", gateway["id"], gateway["address"]))
    started: dict[str, processes.Service] = {}
    try:
        for kind, name, address in starts:
            service = processes.start_service(
                kind, config_path, name, address, logs / f"{kind}.log"
            )
            started[kind] = service
            processes.wait_serving([service])
        yield BenchCluster(run_dir, config_path, started)
    finally:
        for service in reversed(list(started.values())):  # gateway first, like `make stop`
            processes.stop_service(service)


# --- measuring


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime field 14 and stime field 15.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def machine_ticks() -> tuple[int, int, int]:
    """(all, idle + iowait, steal) clock ticks summed over every core, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user]
    return sum(values[:8]), values[3] + values[4], values[7]


def background_load(duration_s: float = 1.0) -> float:
    """How busy the machine is with nothing of ours running, in % of one core."""
    before = machine_ticks()
    time.sleep(duration_s)
    total, idle, _ = (a - b for a, b in zip(machine_ticks(), before, strict=True))
    return round(100 * CORES * (total - idle) / total, 1) if total > 0 else 0.0


@dataclass
class CpuMeter:
    """CPU used by each process over a stretch of wall time, as % of one core.

    Also `others`, the CPU every other process on the machine used meanwhile (% of one
    core), and the whole machine's busy and steal time (% of all its cores): other jobs
    and the hypervisor's steal are the usual reasons a figure wanders between runs.
    """

    pids: dict[str, int]
    started_s: float = 0.0
    before: dict[str, float] = field(default_factory=dict)
    machine_before: tuple[int, int, int] = (0, 0, 0)

    def start(self) -> None:
        """Takes the starting readings."""
        self.before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self.machine_before = machine_ticks()
        self.started_s = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """Per process: CPU seconds used since start() / wall seconds, in percent."""
        wall_s = max(time.perf_counter() - self.started_s, 1e-9)
        used = {
            name: round(100 * (cpu_seconds(pid) - self.before[name]) / wall_s, 1)
            for name, pid in self.pids.items()
        }
        total, idle, steal = (
            a - b for a, b in zip(machine_ticks(), self.machine_before, strict=True)
        )
        if total > 0:
            ours = sum(used.values())
            busy_fraction = (total - idle) / total
            # Whatever else ran meanwhile (other jobs on a shared machine), in % of a core.
            used["others"] = round(max(0.0, 100 * busy_fraction * CORES - ours), 1)
            used["machine_busy"] = round(100 * busy_fraction, 1)
            used["machine_steal"] = round(100 * steal / total, 1)
        return used


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one).

    The smallest value with at least `fraction` of the values at or below it: the median
    of [1, 2, 3, 4, 5] is 3 and p90 of 1..10 is 9. (This used `round`, whose ties go to
    the even number, so the median of five values came out as the second.)
    """
    if not sorted_values:
        return 0.0
    # The epsilon keeps 0.07 * 100 = 7.000000000000001 at rank 7, not 8.
    rank = math.ceil(fraction * len(sorted_values) - 1e-9)
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


def payloads(count: int, size_bytes: int = EVENT_BYTES) -> list[bytes]:
    """count distinct payloads of exactly size_bytes."""
    filler = b"x" * (size_bytes - 12)
    return [b"%012d" % i + filler for i in range(count)]


# --- scenarios


def unary_publish(
    address: str,
    topic: str,
    count: int,
    deadline_s: float,
    meter: CpuMeter,
    keep_samples: bool = False,
) -> dict[str, Any]:
    """One event per call, each waiting for its receipt: per-call latency and rate.

    With keep_samples the result also holds every call's latency (`latency_ms_samples`,
    ascending, in ms), for a latency CDF.
    """
    events = payloads(count)
    latencies_s: list[float] = []
    with squall.connect(address) as client, client.topic(topic).publisher() as publisher:
        publisher.publish(b"warm-up")
        stop_at = time.monotonic() + deadline_s
        meter.start()
        started = time.perf_counter()
        for payload in events:
            if time.monotonic() > stop_at:
                break
            t0 = time.perf_counter()
            publisher.publish(payload)
            latencies_s.append(time.perf_counter() - t0)
        elapsed_s = time.perf_counter() - started
        cpu = meter.stop()
    latencies_s.sort()
    figures: dict[str, Any] = {
        "events": len(latencies_s),
        "seconds": round(elapsed_s, 3),
        "events_per_s": round(len(latencies_s) / elapsed_s),
        "latency_ms_p50": round(1000 * percentile(latencies_s, 0.50), 3),
        "latency_ms_p99": round(1000 * percentile(latencies_s, 0.99), 3),
        "latency_ms_max": round(1000 * (latencies_s[-1] if latencies_s else 0.0), 3),
        "hit_deadline": len(latencies_s) < count,
        "cpu_pct": cpu,
    }
    if keep_samples:
        figures["latency_ms_samples"] = [round(1000 * s, 3) for s in latencies_s]
    return figures


def pipelined_publish(
    address: str, topic: str, count: int, deadline_s: float, meter: CpuMeter
) -> dict[str, Any]:
    """publish_many in batches of BATCH_EVENTS, in chunks so the deadline is checked."""
    events = payloads(count)
    done = 0
    with squall.connect(address) as client, client.topic(topic).publisher() as publisher:
        publisher.publish_many(payloads(WARMUP_EVENTS), batch_events=BATCH_EVENTS)
        stop_at = time.monotonic() + deadline_s
        meter.start()
        started = time.perf_counter()
        while done < count and time.monotonic() < stop_at:
            chunk = events[done : done + CHUNK_EVENTS]
            receipts = publisher.publish_many(chunk, batch_events=BATCH_EVENTS)
            if len(receipts) != len(chunk):
                raise RuntimeError(f"{len(receipts)} receipts for {len(chunk)} events")
            done += len(chunk)
        elapsed_s = time.perf_counter() - started
        cpu = meter.stop()
    return {
        "events": done,
        "batch_events": BATCH_EVENTS,
        "seconds": round(elapsed_s, 3),
        "events_per_s": round(done / elapsed_s),
        "mb_per_s": round(done * EVENT_BYTES / elapsed_s / 1e6, 2),
        "hit_deadline": done < count,
        "cpu_pct": cpu,
    }


def aio_unary_publish(
    address: str, topic: str, count: int, deadline_s: float, meter: CpuMeter
) -> dict[str, Any]:
    """`unary_publish` with the asyncio client (`squall.aio`): one `await publish()` at a
    time, each waiting for its receipt, on one event loop in this process."""
    events = payloads(count)
    latencies_s: list[float] = []

    async def run() -> float:
        async with squall.aio.connect(address) as client:
            async with (await client.topic(topic)).publisher() as publisher:
                await publisher.publish(b"warm-up")
                stop_at = time.monotonic() + deadline_s
                meter.start()
                started = time.perf_counter()
                for payload in events:
                    if time.monotonic() > stop_at:
                        break
                    t0 = time.perf_counter()
                    await publisher.publish(payload)
                    latencies_s.append(time.perf_counter() - t0)
                return time.perf_counter() - started

    elapsed_s = asyncio.run(run())
    cpu = meter.stop()
    latencies_s.sort()
    return {
        "events": len(latencies_s),
        "seconds": round(elapsed_s, 3),
        "events_per_s": round(len(latencies_s) / elapsed_s),
        "latency_ms_p50": round(1000 * percentile(latencies_s, 0.50), 3),
        "latency_ms_p99": round(1000 * percentile(latencies_s, 0.99), 3),
        "latency_ms_max": round(1000 * (latencies_s[-1] if latencies_s else 0.0), 3),
        "hit_deadline": len(latencies_s) < count,
        "cpu_pct": cpu,
    }


def aio_pipelined_publish(
    address: str, topic: str, count: int, deadline_s: float, meter: CpuMeter
) -> dict[str, Any]:
    """`pipelined_publish` with the asyncio client: `await publish_many` in batches of
    BATCH_EVENTS (the same window of in-flight batches), in chunks so the deadline is
    checked."""
    events = payloads(count)

    async def run() -> tuple[int, float]:
        done = 0
        async with squall.aio.connect(address) as client:
            async with (await client.topic(topic)).publisher() as publisher:
                await publisher.publish_many(payloads(WARMUP_EVENTS), batch_events=BATCH_EVENTS)
                stop_at = time.monotonic() + deadline_s
                meter.start()
                started = time.perf_counter()
                while done < count and time.monotonic() < stop_at:
                    chunk = events[done : done + CHUNK_EVENTS]
                    receipts = await publisher.publish_many(chunk, batch_events=BATCH_EVENTS)
                    if len(receipts) != len(chunk):
                        raise RuntimeError(f"{len(receipts)} receipts for {len(chunk)} events")
                    done += len(chunk)
                return done, time.perf_counter() - started

    done, elapsed_s = asyncio.run(run())
    cpu = meter.stop()
    return {
        "events": done,
        "batch_events": BATCH_EVENTS,
        "seconds": round(elapsed_s, 3),
        "events_per_s": round(done / elapsed_s),
        "mb_per_s": round(done * EVENT_BYTES / elapsed_s / 1e6, 2),
        "hit_deadline": done < count,
        "cpu_pct": cpu,
    }


def subscribe(address: str, topic: str, deadline_s: float, meter: CpuMeter) -> dict[str, Any]:
    """Reads the whole topic with a non-follow subscription, message by message."""
    count = 0
    payload_bytes = 0
    with squall.connect(address) as client:
        handle = client.topic(topic)
        stop_at = time.monotonic() + deadline_s
        meter.start()
        started = time.perf_counter()
        with handle.subscribe(start="earliest", follow=False) as subscription:
            # A stream has no deadline of its own: if the server stalls, closing the
            # subscription ends the iteration quietly.
            watchdog = threading.Timer(deadline_s + STALL_GRACE_S, subscription.close)
            watchdog.start()
            try:
                for message in subscription:
                    count += 1
                    payload_bytes += len(message.payload)
                    if count % SUBSCRIBE_CHECK_EVENTS == 0 and time.monotonic() > stop_at:
                        break
            finally:
                watchdog.cancel()
        elapsed_s = time.perf_counter() - started
        cpu = meter.stop()
    return {
        "events": count,
        "seconds": round(elapsed_s, 3),
        "events_per_s": round(count / elapsed_s),
        "mb_per_s": round(payload_bytes / elapsed_s / 1e6, 2),
        "hit_deadline": count < handle.info.next_offset,
        "cpu_pct": cpu,
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rate, plus every run's rate (the spread is part of the figure)."""
    ordered = sorted(runs, key=lambda run: run["events_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["runs_events_per_s"] = [run["events_per_s"] for run in runs]
    # Other jobs' CPU during each run, to tell a slow run from a crowded one.
    chosen["runs_others_pct"] = [run["cpu_pct"].get("others") for run in runs]
    return chosen


def run_policy(
    master_sync: str,
    sizes: Sizes,
    only: set[str],
    run_dir: Path,
    log: Callable[[str], None],
    profiler: Profiler | None = None,
) -> dict[str, Any]:
    """Starts a cluster with this master_sync and runs the chosen scenarios on it.

    Pipelined publish and subscribe run `sizes.repeats` times, each repetition on its own
    topic, and are reported as the median run with every run's rate beside it. The runs
    through the gateway and straight to the replica alternate, so drift in the machine's
    other load hits both alike and their ratio stays fair.
    """
    results: dict[str, Any] = {}
    repeats = range(sizes.repeats)
    with running_cluster(run_dir, master_sync) as cluster:
        # "direct" adds runs straight to the replica beside the gateway's, for the ratio.
        routes: dict[str, str] = {}
        if only & {"pipelined", "subscribe", "direct"}:
            routes[""] = cluster.gateway.address
        if "direct" in only:
            routes["_direct"] = cluster.replica.address
        meter = CpuMeter(cluster.pids)
        with squall.connect(cluster.gateway.address) as client:
            client.create_topic("bench-unary")
            for i in repeats:
                for suffix in routes:
                    client.create_topic(f"bench-pipelined{suffix}-{i}")
        if "unary" in only:
            log(f"  {master_sync}: unary publish, up to {sizes.unary_events} events")
            results["unary_publish"] = unary_publish(
                cluster.gateway.address,
                "bench-unary",
                sizes.unary_events,
                sizes.unary_deadline_s,
                meter,
            )
        publishes: dict[str, list[dict[str, Any]]] = {suffix: [] for suffix in routes}
        if routes:  # the subscribe scenario reads what this stores
            log(f"  {master_sync}: pipelined publish, {sizes.repeats} x {sizes.pipelined_events}")
            with _profiling(profiler, cluster, "publish", master_sync):
                for i in repeats:
                    for suffix, address in routes.items():
                        publishes[suffix].append(
                            pipelined_publish(
                                address,
                                f"bench-pipelined{suffix}-{i}",
                                sizes.pipelined_events,
                                sizes.pipelined_deadline_s,
                                meter,
                            )
                        )
        reads: dict[str, list[dict[str, Any]]] = {suffix: [] for suffix in routes}
        if "subscribe" in only or "direct" in only:
            log(f"  {master_sync}: subscribe, {sizes.repeats} x the whole topic")
            with _profiling(profiler, cluster, "subscribe", master_sync):
                for i in repeats:
                    for suffix, address in routes.items():
                        reads[suffix].append(
                            subscribe(
                                address,
                                f"bench-pipelined{suffix}-{i}",
                                sizes.subscribe_deadline_s,
                                meter,
                            )
                        )
    for suffix in routes:
        if publishes[suffix]:
            results[f"pipelined_publish{suffix}"] = median_of(publishes[suffix])
        if reads[suffix]:
            results[f"subscribe{suffix}"] = median_of(reads[suffix])
    for via, key in (
        ("pipelined_publish", "gateway_publish_fraction"),
        ("subscribe", "gateway_subscribe_fraction"),
    ):
        if via in results and f"{via}_direct" in results:
            results[key] = round(
                results[via]["events_per_s"] / results[f"{via}_direct"]["events_per_s"], 3
            )
    return results


# --- profiling with py-spy


@contextlib.contextmanager
def _profiling(
    profiler: Profiler | None, cluster: BenchCluster, phase: str, master_sync: str
) -> Iterator[None]:
    if profiler is None:
        yield
        return
    with profiler.recording(cluster.pids, f"{master_sync.lower()}-{phase}"):
        yield


class Profiler:
    """Samples processes with `py-spy record` (raw collapsed stacks), one file per process."""

    def __init__(self, executable: str, out_dir: Path, rate_hz: int = 100) -> None:
        self.executable = executable
        self.out_dir = out_dir
        self.rate_hz = rate_hz
        self.summaries: dict[str, dict[str, Any]] = {}

    @classmethod
    def find(cls, out_dir: Path) -> Profiler | None:
        """A profiler if py-spy is installed next to this Python or on PATH, else None."""
        beside = Path(sys.executable).parent / "py-spy"
        if beside.exists():
            return cls(str(beside), out_dir)
        for directory in os.environ.get("PATH", "").split(os.pathsep):
            candidate = Path(directory) / "py-spy"
            if directory and candidate.exists():
                return cls(str(candidate), out_dir)
        return None

    @contextlib.contextmanager
    def recording(self, pids: dict[str, int], label: str) -> Iterator[None]:
        """Records every process in pids while the with-block runs, then summarizes."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        spies: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
        try:
            for name, pid in pids.items():
                out = self.out_dir / f"{label}-{name}.txt"
                err = self.out_dir / f"{label}-{name}.log"
                with open(err, "wb") as err_file:
                    spy = subprocess.Popen(
                        [
                            self.executable,
                            "record",
                            "--pid",
                            str(pid),
                            "--rate",
                            str(self.rate_hz),
                            "--format",
                            "raw",
                            "--nonblocking",
                            "--output",
                            str(out),
                        ],
                        stdout=err_file,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                spies[name] = (spy, out, err)
            time.sleep(0.5)  # py-spy needs a moment to attach; it samples nothing before
            yield
        finally:
            for spy, _, _ in spies.values():
                if spy.poll() is None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            for spy, _, _ in spies.values():
                try:
                    spy.wait(30)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    spy.wait(10)
        for name, (_, out, err) in spies.items():
            summary = summarize_collapsed(out) if out.exists() else None
            if summary is None:
                summary = {"error": processes.tail(err, 5)}
            summary["file"] = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
            self.summaries[f"{label}-{name}"] = summary


# Frames from these trees are ours; their inclusive time says which of our calls cost most.
_OUR_CODE = ("services/", "squall/")


def summarize_collapsed(path: Path, top: int = 15) -> dict[str, Any] | None:
    """Self time per function, and inclusive time of our own functions, from py-spy raw output.

    Raw output is one line per distinct stack: `frame;frame;...;leaf COUNT`, each frame
    `function (file:line)`; lines of one function are added up.
    """
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(frame) for frame in stack.split(";") if frame]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for function in set(frames):
            if " (" in function and function.split(" (", 1)[1].startswith(_OUR_CODE):
                inclusive[function] += count
    if total == 0:
        return None
    return {
        "samples": total,
        "self_pct": {f: round(100 * n / total, 1) for f, n in own.most_common(top)},
        "ours_inclusive_pct": {f: round(100 * n / total, 1) for f, n in inclusive.most_common(top)},
    }


def _function(frame: str) -> str:
    """'name (path/file.py:123)' -> 'name (path/file.py)', so one function's lines add up."""
    name, _, where = frame.partition(" (")
    if not where:
        return name.strip()
    return f"{name.strip()} ({where.rstrip(')').rsplit(':', 1)[0]})"
