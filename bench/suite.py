"""`make bench`: the benchmark report, one directory per run (JSON, Markdown, PNG plots).

    python -m bench.suite                      # the default run, ~12 minutes on 2 cores
    python -m bench.suite --tiny               # the smoke run the integration test uses
    python -m bench.suite --tiny --gap-trials 2 --gap-kind replica_pause  # gap smoke run
    python -m bench.suite --repeats 5 --failover-trials 50   # longer, steadier figures
    make bench BENCH_ARGS="--policy SYNC --unary-events 10000"

For each sync policy (SYNC, WRITE_NO_SYNC, NO_SYNC: `master_sync` and `replica_sync`
both set to it, acks majority) a fresh three-node cluster from
deploy/cluster.example.toml runs as real processes on loopback with one gateway, and the
existing scenarios run on it through the gateway: pipelined publish
(`single_node.pipelined_publish`, `--repeats` topics, median run), one-at-a-time publish
keeping every call's latency (`single_node.unary_publish`), and a consume pass reading
each pipelined topic from the earliest offset (`single_node.subscribe`). Every service's
RSS is read at idle (settled, nothing published) and after that load. On the SYNC
cluster (the default master policy) a slave is then killed and timed catching up
(`replicated.catch_up`). Then `failover.run` kills the master node of a fresh cluster
`--failover-trials` times. Last, `fault_gaps.run` measures the publisher-visible gap per
fault kind (node kill, replica kill and pause, coordinator kill and pause, the restarted
n1 taking the lead back) through the gateway and both publisher proxies at once,
`--gap-trials` trials per kind on one fresh cluster per kind. The machine is described
at the start (`machine.describe`: CPU, cores, RAM, versions, git commit, load average)
and its load average read again at the end.

Output: bench/results/<UTC stamp>/report.json, report.md and *.png, and
bench/results/latest pointing at that directory. A measurement, not a test: it fails
only when a cluster cannot start or a publish fails, never because a figure is low.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import squall
from bench import (
    consumers,
    failover,
    fault_gaps,
    latency,
    machine,
    memory,
    replicated,
    report,
    single_node,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
POLICIES = ("SYNC", "WRITE_NO_SYNC", "NO_SYNC")
# Catch-up runs on this policy's cluster when it is measured (the default master policy).
CATCH_UP_POLICY = "SYNC"
ACKS = "majority"
LATENCY_DEFAULT = latency.Sizes()


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does; a zero turns catch-up or failover off."""

    pipelined_events: int
    pipelined_deadline_s: float
    repeats: int
    unary_events: int
    unary_deadline_s: float
    subscribe_deadline_s: float
    catch_up_events: int
    failover_trials: int
    gap_trials: int
    # The latency scenarios (bench/latency.py); None skips them.
    latency: latency.Sizes | None = LATENCY_DEFAULT
    # The consumer scenarios (bench/consumers.py: shared subscriptions, reads from
    # replicas); None skips them.
    consumers: consumers.Sizes | None = None

    @classmethod
    def default(cls) -> Sizes:
        """`make bench`: roughly 12 minutes on a 2-core machine."""
        return cls(
            pipelined_events=200_000,
            pipelined_deadline_s=30.0,
            repeats=3,
            unary_events=3_000,
            unary_deadline_s=20.0,
            subscribe_deadline_s=20.0,
            catch_up_events=300_000,
            failover_trials=30,
            gap_trials=fault_gaps.TRIALS_DEFAULT,
            consumers=consumers.Sizes.default(),
        )

    @classmethod
    def tiny(cls) -> Sizes:
        """A smoke run of the whole pipeline: seconds per cluster, no catch-up, failover or
        fault gaps."""
        return cls(
            pipelined_events=2_000,
            pipelined_deadline_s=10.0,
            repeats=1,
            unary_events=50,
            unary_deadline_s=5.0,
            subscribe_deadline_s=5.0,
            catch_up_events=0,
            failover_trials=0,
            gap_trials=0,
            latency=latency.Sizes.tiny(),
        )


def measure_policy(
    policy: str, sizes: Sizes, run_dir: Path, log: Callable[[str], None], catch_up: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One fresh cluster with this sync policy; its figures, and catch-up's if asked for."""
    durability = {"master_sync": policy, "replica_sync": policy, "acks": ACKS}
    figures: dict[str, Any] = {"durability": durability}
    catch_figures: dict[str, Any] | None = None
    # Stage marks (squall.wire.stages) for the latency budget, from every process of this
    # cluster and this one; a per-event cost of about a microsecond per mark.
    stages = latency.stage_dir(run_dir) if sizes.latency is not None else None
    with (
        latency.stage_marks(stages),
        replicated.running(run_dir, durability=dict(durability)) as cluster,
    ):
        address = cluster.gateway_address
        topics = [f"bench-pipelined-{i}" for i in range(sizes.repeats)]
        aio_topics = [f"bench-aio-pipelined-{i}" for i in range(sizes.repeats)]
        with squall.connect(address) as client:
            for topic in (*topics, *aio_topics, "bench-unary", "bench-aio-unary", "bench-catch-up"):
                client.create_topic(topic)
        services = {k: v for k, v in cluster.pids().items() if k != "client"}
        figures["memory"] = {"idle": memory.sample(services)}
        meter = single_node.CpuMeter(cluster.pids())
        log(
            f"  {policy}: pipelined publish, threaded and asyncio clients, "
            f"{sizes.repeats} x {sizes.pipelined_events:,} each"
        )
        # The threaded and the asyncio client take turns, so both see the same machine.
        runs: list[dict[str, Any]] = []
        aio_runs: list[dict[str, Any]] = []
        for topic, aio_topic in zip(topics, aio_topics, strict=True):
            runs.append(
                single_node.pipelined_publish(
                    address, topic, sizes.pipelined_events, sizes.pipelined_deadline_s, meter
                )
            )
            aio_runs.append(
                single_node.aio_pipelined_publish(
                    address, aio_topic, sizes.pipelined_events, sizes.pipelined_deadline_s, meter
                )
            )
        figures["pipelined_publish"] = single_node.median_of(runs)
        figures["aio"] = {"pipelined_publish": single_node.median_of(aio_runs)}
        log(f"  {policy}: one at a time, up to {sizes.unary_events:,} events")
        figures["one_at_a_time"] = single_node.unary_publish(
            address,
            "bench-unary",
            sizes.unary_events,
            sizes.unary_deadline_s,
            meter,
            keep_samples=True,
        )
        log(f"  {policy}: asyncio client, one at a time, up to {sizes.unary_events:,} events")
        figures["aio"]["one_at_a_time"] = single_node.aio_unary_publish(
            address, "bench-aio-unary", sizes.unary_events, sizes.unary_deadline_s, meter
        )
        log(f"  {policy}: consume, {sizes.repeats} x a whole pipelined topic")
        reads = [
            single_node.subscribe(address, topic, sizes.subscribe_deadline_s, meter)
            for topic in topics
        ]
        figures["subscribe"] = single_node.median_of(reads)
        # Before catch-up, which restarts a node: these are the processes that took the load.
        figures["memory"]["after_load"] = memory.sample(services)
        if sizes.latency is not None:
            log(f"  {policy}: latency (one at a time, concurrent publishers, delivery, budget)")
            figures["latency"] = latency.measure(
                address, cluster.pids(), stages, sizes.latency, "latency", log, data_dir=run_dir
            )
        if catch_up:
            log(f"  {policy}: catch-up of a slave {sizes.catch_up_events:,} events behind")
            catch_figures = {
                **replicated.catch_up(cluster, sizes.catch_up_events, log),
                "policy": policy,
            }
    return figures, catch_figures


def main(argv: list[str] | None = None) -> int:
    """Measures, then writes the report; returns an exit status."""
    parser = argparse.ArgumentParser(
        prog="bench.suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a smoke run (tiny sizes, no catch-up or failover)"
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        help="measure only this sync policy (repeatable; default: all three)",
    )
    for name, help_text in (
        ("pipelined-events", "events per pipelined run"),
        ("repeats", "pipelined and consume runs per policy (median reported)"),
        ("unary-events", "one-at-a-time publishes per policy (latency samples)"),
        ("catch-up-events", "events the killed slave falls behind (0: skip catch-up)"),
        ("failover-trials", "master kills (0: skip failover)"),
        ("gap-trials", "trials per fault kind of the publisher-visible gap (0: skip)"),
    ):
        parser.add_argument(f"--{name}", type=int, metavar="N", help=help_text)
    parser.add_argument(
        "--gap-kind",
        action="append",
        choices=fault_gaps.INJECTED,
        help="measure the gap for this fault kind only (repeatable; default all; "
        "node_kill also gives lead_back)",
    )
    parser.add_argument(
        "--gap-prefill",
        type=int,
        default=0,
        metavar="N",
        help="log entries published before a fault kind's trials (a long log for "
        "lead_back's truncation; default 0)",
    )
    parser.add_argument(
        "--consumers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the consumer scenarios (bench/consumers.py; default: on, off with --tiny)",
    )
    parser.add_argument(
        "--no-latency",
        action="store_true",
        help="skip the latency scenarios (bench/latency.py)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where the run's directory goes (default bench/results)",
    )
    args = parser.parse_args(argv)

    sizes = Sizes.tiny() if args.tiny else Sizes.default()
    overrides = {
        key: getattr(args, key)
        for key in (
            "pipelined_events",
            "repeats",
            "unary_events",
            "catch_up_events",
            "failover_trials",
            "gap_trials",
        )
        if getattr(args, key) is not None
    }
    if any(value < 0 for value in overrides.values()) or overrides.get("repeats") == 0:
        parser.error("sizes must be >= 0 (and --repeats >= 1)")
    sizes = replace(sizes, **overrides)
    if args.no_latency:
        sizes = replace(sizes, latency=None)
    if args.consumers is not None:
        wanted = consumers.Sizes.tiny() if args.tiny else consumers.Sizes.default()
        sizes = replace(sizes, consumers=wanted if args.consumers else None)
    policies = [p for p in POLICIES if p in (args.policy or POLICIES)]
    catch_up_policy = CATCH_UP_POLICY if CATCH_UP_POLICY in policies else policies[-1]

    started_at = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    catch_figures: dict[str, Any] | None = None
    fail_figures: dict[str, Any] | None = None
    gap_figures: dict[str, Any] | None = None
    consumer_figures: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="squall-bench-report-") as temp:
        described = machine.describe(Path(temp))
        log(f"bench: {machine.summary(described)}; load average {described['load_average']}")
        background = single_node.background_load()
        for policy in policies:
            log(f"bench: 3 nodes, master_sync = replica_sync = {policy}")
            wants_catch_up = policy == catch_up_policy and sizes.catch_up_events > 0
            results[policy], caught = measure_policy(
                policy, sizes, Path(temp) / policy.lower(), log, wants_catch_up
            )
            catch_figures = caught or catch_figures
        if sizes.failover_trials > 0:
            log(f"bench: failover, {sizes.failover_trials} kills of the master node")
            fail_figures = failover.run(sizes.failover_trials)
        if sizes.gap_trials > 0:
            gap_figures = fault_gaps.run(
                sizes.gap_trials,
                Path(temp) / "gaps",
                log,
                args.gap_kind or fault_gaps.INJECTED,
                max(0, args.gap_prefill),
            )
        if sizes.consumers is not None:
            log("bench: consumers (shared subscriptions; reads from replicas), 3 nodes")
            consumer_figures = consumers.run(sizes.consumers, Path(temp) / "consumers", log)
    assembled = report.assemble(
        started_at=started_at,
        seconds=time.monotonic() - started,
        machine=described,
        load_average_end=machine.load_average(),
        background_load_pct_of_core=background,
        setup={
            "command": " ".join(
                ["python -m bench.suite", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]
            ),
            "template": "deploy/cluster.example.toml",
            "nodes": 3,
            "event_bytes": single_node.EVENT_BYTES,
            "batch_events": single_node.BATCH_EVENTS,
            "acks": ACKS,
            "policies": policies,
            "sizes": {
                k: v
                for k, v in asdict(sizes).items()
                if not k.endswith("_s") and k not in ("latency", "consumers")
            },
            "latency_sizes": asdict(sizes.latency) if sizes.latency is not None else None,
            "consumer_sizes": asdict(sizes.consumers) if sizes.consumers is not None else None,
            "deadlines_s": {k: v for k, v in asdict(sizes).items() if k.endswith("_s")},
        },
        policies=results,
        catch_up=catch_figures,
        failover=fail_figures,
        fault_gaps=gap_figures,
        consumers=consumer_figures,
    )
    run_dir = args.results_dir / started_at
    paths = report.write(assembled, run_dir)
    latest = report.point_latest(args.results_dir, run_dir)
    print(paths["markdown"].read_text())
    print(f"written: {run_dir} (also {latest})")
    return 0


def log(line: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
