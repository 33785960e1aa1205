"""`python -m chaos run --seed S --duration D [--nodes 3|5] [--out DIR]`: one chaos run.

Builds the network namespaces (chaos/netns.py), starts the cluster (chaos/cluster.py),
starts the workload, plays the seeded fault schedule (chaos/faults.py) for D seconds,
heals everything, waits for a normal cluster, stops the workload (it drains), shuts the
cluster down cleanly (`squall cluster shutdown`), writes each node's committed log per
topic (``final_log``) and ``end`` to the history, then runs the checker and prints its
summary line and the timeline PNG. Exit status 0 only when the run completed and the
checker found nothing; otherwise it prints the command that reproduces the run.

Every process is stopped by PID and every namespace deleted in ``finally`` blocks, also
when the run fails or is interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from chaos import faults as faults_module
from chaos.checker import check as check_history
from chaos.cluster import DEFAULT_SETTINGS, GATEWAY_IDS, ChaosCluster, node_ids
from chaos.faults import FaultOutcome, FaultRunner
from chaos.history import HistoryWriter, read_history
from chaos.netns import NetnsError, Topology, can_create
from chaos.timeline import plot_timeline
from chaos.workload import Target
from chaos.workload import Workload as FullWorkload

log = logging.getLogger("chaos")

# What a run has started and not yet cleaned up: stopped and deleted at interpreter exit
# too, for a run cut short where its finally blocks cannot run (a second Ctrl-C, an
# interrupt while the event loop thread waits on a lock).
_LIVE: list[ChaosCluster | Topology] = []


def _clean_up_left_overs() -> None:
    while _LIVE:
        thing = _LIVE.pop()
        try:
            if isinstance(thing, ChaosCluster):
                thing.stop_all()
            else:
                thing.teardown()
        except Exception as exc:  # best effort at exit: say what is left, go on
            print(f"chaos: cleaning up {thing!r:.80}: {exc}", file=sys.stderr)


atexit.register(_clean_up_left_overs)

TOPICS = ["chaos-a", "chaos-b"]
DRAIN_TIMEOUT_S = 30.0
_WORKLOAD_STOP_SLACK_S = 15.0
_START_TIMEOUT_S = 90.0
_FINAL_NORMAL_TIMEOUT_S = 60.0


class Workload(Protocol):
    """What the runner needs of a workload (chaos.workload.Workload is one)."""

    async def start(self) -> None: ...

    async def stop(self, drain_timeout_s: float) -> None: ...


WorkloadFactory = Callable[[Target, HistoryWriter, int, list[str]], Workload]


def make_target(gateway_addresses: list[str], host_address: str) -> Target:
    """What the workload connects to."""
    return Target(gateway_addresses=gateway_addresses, host_address=host_address)


def default_workload(
    target: Target, history: HistoryWriter, seed: int, topics: list[str]
) -> Workload:
    """chaos.workload.Workload with its default publishers and subscribers."""
    return FullWorkload(target, history, seed, topics)


# The ack policies a run may set: those under which an acknowledged event must survive
# every fault the schedule plays (under `none` a master's crash may lose some).
ACK_POLICIES = ("majority", "group")


@dataclass
class RunResult:
    """How a run went."""

    seed: int
    duration_s: float
    nodes: int
    history_path: Path
    completed: bool = False
    problems: list[str] = field(default_factory=list)
    outcomes: list[FaultOutcome] = field(default_factory=list)
    checked: bool = False
    check_ok: bool = False
    summary: str = ""
    png_path: Path | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    # What publishers saw per fault kind (the checker's kind_lines).
    kind_lines: list[str] = field(default_factory=list)
    acks: str = "majority"  # the cluster's durability.acks

    @property
    def ok(self) -> bool:
        return self.completed and not self.problems and self.checked and self.check_ok

    def reproduce(self) -> str:
        return (
            f"reproduce: make chaos SEED={self.seed} DURATION={self.duration_s:g} "
            f"NODES={self.nodes}" + (f" ACKS={self.acks}" if self.acks != "majority" else "")
        )


def enabled_kinds(
    requested: list[str] | None, netns_ok: bool, why: str
) -> tuple[list[str], dict[str, str]]:
    """The fault kinds a run plays, and why each other requested kind is left out."""
    kinds = list(requested or faults_module.KINDS)
    unknown = [kind for kind in kinds if kind not in faults_module.KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}; known: {list(faults_module.KINDS)}")
    skipped: dict[str, str] = {}
    for kind in list(kinds):
        if kind in faults_module.NOT_APPLICABLE:
            skipped[kind] = "not applicable: " + faults_module.NOT_APPLICABLE[kind]
        elif kind in faults_module.NEEDS_NETNS and not netns_ok:
            skipped[kind] = f"left out: {why}"
    return [kind for kind in kinds if kind not in skipped], skipped


async def run_chaos(
    seed: int,
    duration_s: float,
    nodes: int,
    out_dir: Path,
    workload_factory: WorkloadFactory | None = None,
    kinds: list[str] | None = None,
    topics: list[str] | None = None,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    quiet_after_faults_s: float | None = None,
    acks: str = "majority",
) -> RunResult:
    """One chaos run into out_dir (history.jsonl, cluster logs, timeline.png), the
    cluster's ``durability.acks`` set to ``acks``.

    The load runs for duration_s; with quiet_after_faults_s, only that long (and never
    past duration_s) once the schedule has been played: the schedule sets aside time for
    slow recoveries (faults.py, _RECOVERY_ALLOWANCE_S) that a fast one leaves idle, and a
    short run (tests/chaos/test_chaos_short.py) need not wait it out. The same seed plays
    the same faults either way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    history_path = out_dir / "history.jsonl"
    if history_path.exists():
        raise FileExistsError(f"{history_path} exists: give every run its own --out")
    if acks not in ACK_POLICIES:
        raise ValueError(f"acks must be one of {', '.join(ACK_POLICIES)}, not {acks!r}")
    result = RunResult(seed, duration_s, nodes, history_path, acks=acks)
    ids = node_ids(nodes)
    topics = list(topics or TOPICS)
    netns_ok, why = can_create()
    enabled, result.skipped = enabled_kinds(kinds, netns_ok, why)
    factory = workload_factory or default_workload
    topology: Topology | None = None
    cluster: ChaosCluster | None = None
    workload: Workload | None = None
    workload_stopped = False
    history = HistoryWriter(history_path)
    runner: FaultRunner | None = None
    try:
        if netns_ok:
            topology = Topology.plan(ids)
            _LIVE.append(topology)
            topology.create()
        settings = {"durability": {**DEFAULT_SETTINGS["durability"], "acks": acks}}
        cluster = ChaosCluster.build(out_dir, nodes, topology, settings)
        _LIVE.append(cluster)
        history.write(
            "run",
            seed=seed,
            duration_s=duration_s,
            acks=acks,
            nodes=ids,
            gateways=list(GATEWAY_IDS),
            faults=enabled,
            topics=topics,
            started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            faults_skipped=result.skipped,
            netns=topology is not None,
            host_address=cluster.host_address,
        )
        await asyncio.to_thread(cluster.start_all, _START_TIMEOUT_S)
        target = make_target(cluster.gateway_addresses, cluster.host_address)
        workload = factory(target, history, seed, topics)
        await workload.start()
        deadline = time.monotonic() + duration_s
        specs = faults_module.schedule(seed, duration_s, ids, list(GATEWAY_IDS), enabled)
        runner = FaultRunner(cluster, history)
        await runner.run(specs, deadline)
        result.outcomes = runner.outcomes
        # The rest of the duration runs fault-free (bounded by the deadline).
        end = deadline
        if quiet_after_faults_s is not None:
            end = min(deadline, time.monotonic() + quiet_after_faults_s)
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        await asyncio.to_thread(runner.heal_all)
        await asyncio.to_thread(cluster.wait_normal, _FINAL_NORMAL_TIMEOUT_S)
        workload_stopped = True
        await asyncio.wait_for(
            workload.stop(drain_timeout_s), drain_timeout_s + _WORKLOAD_STOP_SLACK_S
        )
        await asyncio.to_thread(cluster.shutdown)
        for record in await asyncio.to_thread(cluster.final_logs, topics):
            if "error" in record:
                result.problems.append(f"final log of {record['node']}: {record['error']}")
            history.write("final_log", **record)
        history.write("end", reason="completed")
        result.completed = True
    except (Exception, asyncio.CancelledError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        result.problems.append(reason)
        history.write("end", reason=f"aborted: {reason}")
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        if runner is not None:
            result.outcomes = runner.outcomes
            result.problems.extend(runner.findings)
        if workload is not None and not workload_stopped:
            try:
                await asyncio.wait_for(workload.stop(1.0), 1.0 + _WORKLOAD_STOP_SLACK_S)
            except (TimeoutError, Exception) as exc:
                result.problems.append(f"stopping the workload: {exc}")
        if cluster is not None:
            await asyncio.to_thread(cluster.stop_all)
            _LIVE.remove(cluster)
        if topology is not None:
            left = await asyncio.to_thread(topology.teardown)
            _LIVE.remove(topology)
            if left:
                result.problems.append(f"could not delete: {', '.join(left)}")
        history.close()
    check(result, out_dir)
    return result


def check(result: RunResult, out_dir: Path) -> None:
    """Runs the checker and the timeline plot over the history."""
    report = check_history(result.history_path)
    result.checked = True
    result.check_ok = bool(report.ok)
    result.summary = report.summary_line()
    result.kind_lines = report.kind_lines()
    png = out_dir / "timeline.png"
    plot_timeline(read_history(result.history_path), png)
    result.png_path = png


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaos run", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="the fault schedule's seed")
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of faults and load (default 60)"
    )
    parser.add_argument("--nodes", type=int, choices=(3, 5), default=3, help="cluster size")
    parser.add_argument(
        "--acks",
        choices=ACK_POLICIES,
        default="majority",
        help="the cluster's durability.acks (default majority)",
    )
    parser.add_argument("--out", type=Path, help="run directory (default .run/chaos/seed-S-...)")
    parser.add_argument(
        "--faults",
        help=f"comma-separated fault kinds (default all: {','.join(faults_module.KINDS)})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one chaos run from the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.duration <= 0:
        print(f"chaos: --duration must be > 0, not {args.duration}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The library logs every reconnect of the workload's clients while a fault lasts; the
    # history records what they saw, so the run's output keeps to faults and results.
    logging.getLogger("squall").setLevel(logging.WARNING)
    # A terminated run cleans up as an interrupted one does (finally blocks, then atexit).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    out = args.out or Path(".run") / "chaos" / f"seed-{args.seed}-{stamp}"
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()] if args.faults else None
    try:
        result = asyncio.run(
            run_chaos(args.seed, args.duration, args.nodes, out, kinds=kinds, acks=args.acks)
        )
    except (ValueError, FileExistsError, NetnsError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    print(report(result))
    return 0 if result.ok else 1


def report(result: RunResult) -> str:
    """What a run prints: faults and their outcomes, problems, summary, PNG, reproduce."""
    lines = [
        f"chaos run seed={result.seed} duration={result.duration_s:g}s nodes={result.nodes}"
        f" acks={result.acks}"
    ]
    for kind, why in result.skipped.items():
        lines.append(f"  fault {kind} {why}")
    for outcome in result.outcomes:
        state = f"recovered in {outcome.recovery_s:.1f}s" if outcome.recovered else "NOT recovered"
        lines.append(f"  {outcome.describe()}: {state}; {outcome.detail}")
    lines.extend(f"  PROBLEM: {problem}" for problem in result.problems)
    lines.append(result.summary)
    lines.extend(result.kind_lines)
    lines.append(f"history: {result.history_path}")
    if result.png_path is not None:
        lines.append(f"timeline: {result.png_path}")
    if not result.ok:
        lines.append(result.reproduce())
    return "\n".join(lines)
