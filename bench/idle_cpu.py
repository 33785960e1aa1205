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
median process and the sum); with ``--threads``, each process's CPU by thread name
(``/proc/PID/task/*/comm``; gRPC names its pollers and timer threads). ``--windows N``
measures N windows back to back on the same cluster. ``--json`` prints the figures as one
JSON document instead.

``python -m bench.idle_cpu [--seconds S] [--settle S] [--windows N] [--threads]
[--json]``. A measurement, not a test; it fails only when the cluster does not start or
settle. Every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import replicated

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


def measure(
    pids: dict[str, int], seconds: float, threads: bool
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """CPU % of one core per process over one window (and per thread name)."""
    before = {name: cpu_ticks(pid) for name, pid in pids.items()}
    threads_before = {name: thread_ticks(pid) for name, pid in pids.items()} if threads else {}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    percent: dict[str, float] = {}
    by_thread: dict[str, dict[str, float]] = {}
    for name, pid in pids.items():
        start, end = before[name], cpu_ticks(pid)
        if start is None or end is None:
            raise RuntimeError(f"{name} (pid {pid}) exited during the measurement")
        percent[name] = 100.0 * (end - start) / _TICKS_PER_S / elapsed
        if threads:
            delta = thread_ticks(pid)
            delta.subtract(threads_before[name])
            by_thread[name] = {
                thread: 100.0 * ticks / _TICKS_PER_S / elapsed
                for thread, ticks in delta.most_common()
                if ticks > 0
            }
    return percent, by_thread


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
                percent, by_thread = measure(pids, args.seconds, args.threads)
                windows.append(
                    {"processes": percent, "roles": summary(percent), "threads": by_thread}
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
            lines.append(f"  {name:<16} {value:6.2f} %")
            for thread, share in window["threads"].get(name, {}).items():
                lines.append(f"      {thread:<20} {share:6.2f} %")
        for role, figures in window["roles"].items():
            lines.append(
                f"  {role:<12} median {figures['median']:6.2f} %  sum {figures['sum']:6.2f} %"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of one window")
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds idle before the first window"
    )
    parser.add_argument("--windows", type=int, default=1, help="windows back to back")
    parser.add_argument("--threads", action="store_true", help="CPU per thread name too")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    results = run(args)
    print(json.dumps(results, indent=2) if args.json else text(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
