"""`make bench`: single-node throughput and latency through the gateway, written as JSON.

    python -m bench.run                 # the full run, a few minutes
    python -m bench.run --quick         # a smoke run, under a minute
    python -m bench.run --only pipelined --policy WRITE_NO_SYNC --profile

Writes bench/results/<timestamp>-single-node.json and bench/results/latest.json, and
prints a Markdown table. This is a measurement, not a test: it fails only if the
cluster cannot start or a publish fails, never because a figure is low. See
bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import failover, machine, publish_gap, replicated, single_node, spark, transfer

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The aims the issue set, for WRITE_NO_SYNC on a 2-core machine (events/s).
AIMS = {"pipelined_publish": 50_000, "subscribe": 100_000}
# Failover trials (kill -9 of the master node, three nodes) in a full and a quick run.
FAILOVER_TRIALS = 12
FAILOVER_TRIALS_QUICK = 3
# Other work above this (% of one core) before the run starts earns a warning.
BACKGROUND_WARN_PCT = 20.0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns an exit status."""
    parser = argparse.ArgumentParser(
        prog="bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument(
        "--only",
        action="append",
        choices=(
            *single_node.SCENARIOS,
            "failover",
            "replicated",
            "publish_gap",
            "transfer",
            "spark",
        ),
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(single_node.SCENARIOS)}, "
        "failover, replicated, publish_gap, transfer (3 nodes); spark (3 nodes and Spark "
        "local[2], only when asked for); "
        "subscribe and direct also run the pipelined publish whose events they read",
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=single_node.POLICIES,
        help="measure only this master_sync policy (repeatable; default: both)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="sample client, gateway and replica with py-spy during the pipelined publish "
        "and subscribe (perturbs those figures a little; stacks go to bench/results/profiles/)",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)

    sizes = single_node.Sizes.quick() if args.quick else single_node.Sizes.full()
    only = set(args.only or single_node.SCENARIOS)
    three_node = {"failover", "replicated", "publish_gap", "transfer", "spark"}
    policies = [p for p in single_node.POLICIES if p in (args.policy or single_node.POLICIES)]
    stamp = time.strftime("%Y%m%dT%H%M%S")
    profiler = None
    if args.profile:
        profiler = single_node.Profiler.find(args.results_dir / "profiles" / stamp)
        if profiler is None:
            print(
                "bench: py-spy not found; `.venv/bin/pip install py-spy` to profile",
                file=sys.stderr,
            )
            return 2

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="squall-bench-") as temp:
        described = machine.describe(Path(temp))
        log(f"bench: {machine.summary(described)}")
        background_pct = single_node.background_load()
        if background_pct > BACKGROUND_WARN_PCT:
            log(
                f"bench: WARNING: the machine is already {background_pct:.0f}% of a core busy "
                "with other work; the figures will be low and will wander"
            )
        runs: dict[str, Any] = {}
        failover_figures: dict[str, Any] | None = None
        if not args.only or "failover" in args.only:
            trials = FAILOVER_TRIALS_QUICK if args.quick else FAILOVER_TRIALS
            log(f"bench: failover, {trials} trials (3 nodes, kill -9 of the master node)")
            failover_figures = failover.run(trials)
        replicated_figures: dict[str, Any] | None = None
        if not args.only or "replicated" in args.only:
            sizes_replicated = replicated.Sizes.quick() if args.quick else replicated.Sizes.full()
            replicated_figures = replicated.run(sizes_replicated, Path(temp) / "replicated", log)
        gap_figures: dict[str, Any] | None = None
        if not args.only or "publish_gap" in args.only:
            sizes_gap = publish_gap.Sizes.quick() if args.quick else publish_gap.Sizes.full()
            gap_figures = publish_gap.run(sizes_gap, Path(temp) / "publish-gap", log)
        transfer_figures: dict[str, Any] | None = None
        if not args.only or "transfer" in args.only:
            sizes_transfer = transfer.Sizes.quick() if args.quick else transfer.Sizes.full()
            log(f"bench: transfer, {sizes_transfer.trials} graceful leadership transfers")
            transfer_figures = transfer.run(sizes_transfer, Path(temp) / "transfer", log)
        spark_figures: dict[str, Any] | None = None
        # Opt-in: it needs Java and the spark extra, and a JVM start-up of its own.
        if args.only and "spark" in args.only:
            sizes_spark = spark.Sizes.quick() if args.quick else spark.Sizes.full()
            spark_figures = spark.run(sizes_spark, Path(temp) / "spark", log)
        for policy in policies if (not args.only or only - three_node) else []:
            log(f"bench: master_sync={policy}")
            runs[policy] = single_node.run_policy(
                policy, sizes, only, Path(temp) / policy.lower(), log, profiler
            )
    report: dict[str, Any] = {
        "benchmark": "single-node",
        "started_at": stamp,
        "mode": "quick" if args.quick else "full",
        # py-spy takes CPU from the processes it samples: profiled figures read low.
        "profiled": profiler is not None,
        "seconds": round(time.monotonic() - started, 1),
        "machine": described,
        "setup": {
            "template": "deploy/single.toml",
            "event_bytes": single_node.EVENT_BYTES,
            "batch_events": single_node.BATCH_EVENTS,
            "sizes": vars(sizes),
            "aims_events_per_s": {**AIMS, "policy": "WRITE_NO_SYNC", "cores": 2},
            "replicated_aims_events_per_s": replicated.AIMS,
            "replicated_sizes": vars(
                replicated.Sizes.quick() if args.quick else replicated.Sizes.full()
            ),
            "publish_gap_sizes": vars(
                publish_gap.Sizes.quick() if args.quick else publish_gap.Sizes.full()
            ),
            "note": "the client and every service process share this machine's cores",
            "background_load_pct_of_core": background_pct,
        },
        "runs": runs,
        "failover": failover_figures,
        "replicated": replicated_figures,
        "publish_gap": gap_figures,
        "transfer": transfer_figures,
        "spark": spark_figures,
    }
    if profiler is not None:
        report["profiles"] = profiler.summaries
    args.results_dir.mkdir(parents=True, exist_ok=True)
    # A run of the replicated or publish-gap scenarios alone is filed as such and leaves
    # latest.json (the single-node figures) alone.
    kind = "single-node"
    if not runs and replicated_figures:
        kind = "replicated"
    elif not runs and gap_figures:
        kind = "publish-gap"
    elif not runs and transfer_figures:
        kind = "transfer"
    elif not runs and spark_figures:
        kind = "spark"
    report["benchmark"] = kind
    path = args.results_dir / f"{stamp}-{kind}.json"
    text = json.dumps(report, indent=2) + "\n"
    path.write_text(text)
    latest = "latest.json" if kind == "single-node" else f"latest-{kind}.json"
    (args.results_dir / latest).write_text(text)
    print()
    print(markdown_table(report))
    if replicated_figures:
        print()
        print(replicated.table(replicated_figures))
    if gap_figures:
        print()
        print(publish_gap.table(gap_figures))
    if transfer_figures:
        print()
        print(transfer.table(transfer_figures))
    if spark_figures:
        print()
        print(spark.table(spark_figures))
    print(f"\nwritten: {path}")
    return 0


def log(line: str) -> None:
    """Progress goes to stderr, so stdout holds only the table."""
    print(line, file=sys.stderr, flush=True)


def markdown_table(report: dict[str, Any]) -> str:
    """The figures as a Markdown table, one column per policy."""
    runs: dict[str, dict[str, Any]] = report["runs"]
    policies = list(runs)
    # A three-node-only run has no policy columns: its figures go in one column.
    columns = policies or ["3 nodes"]
    rows: list[tuple[str, str, str]] = [
        ("unary publish", "unary_publish", "events_per_s"),
        ("unary publish p50 (ms)", "unary_publish", "latency_ms_p50"),
        ("unary publish p99 (ms)", "unary_publish", "latency_ms_p99"),
        ("pipelined publish", "pipelined_publish", "events_per_s"),
        ("subscribe", "subscribe", "events_per_s"),
        ("pipelined publish, direct to replica", "pipelined_publish_direct", "events_per_s"),
        ("subscribe, direct to replica", "subscribe_direct", "events_per_s"),
        ("gateway/direct, publish", "gateway_publish_fraction", ""),
        ("gateway/direct, subscribe", "gateway_subscribe_fraction", ""),
    ]
    lines = [
        "| figure (events/s unless noted; median (min-max) of repeats) | "
        + " | ".join(columns)
        + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, scenario, key in rows:
        cells = [_cell(runs[p].get(scenario), key) for p in policies]
        if any(cell != "-" for cell in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    fail = report.get("failover")
    if fail:
        lines.append(
            f"| failover, kill -9 of the master to a new normal master (ms, "
            f"{fail['trials']} trials) | p50 {fail['p50_ms']}, max {fail['max_ms']} |"
            + " |"
            * max(0, len(columns) - 1)
        )
    gap = report.get("publish_gap")
    for label, name in (
        ("gateway", "through the gateway"),
        ("replicated_proxy", "replicated proxy"),
    ):
        figures = (gap or {}).get(label)
        if figures:
            lines.append(
                f"| publish gap {name}, kill -9 of the master to the next receipt (ms, "
                f"{figures['trials']} trials) | p50 {figures['p50_ms']}, max {figures['max_ms']} |"
                + " |"
                * max(0, len(columns) - 1)
            )
    delivery = (gap or {}).get("delivery")
    if delivery:
        lines.append(
            "| publish-to-delivery, following subscriber via the gateway (ms) | "
            f"p50 {delivery['latency_ms_p50']}, p99 {delivery['latency_ms_p99']} |"
            + " |"
            * max(0, len(columns) - 1)
        )
    lines.append("")
    lines.append(f"machine: {machine.summary(report['machine'])}")
    background = report["setup"]["background_load_pct_of_core"]
    lines.append(f"other load before the run: {background:.0f}% of one core")
    cpu_lines = []
    for policy in policies:
        for scenario, figures in runs[policy].items():
            if isinstance(figures, dict) and "cpu_pct" in figures:
                cpu = ", ".join(f"{k} {v:.0f}%" for k, v in figures["cpu_pct"].items())
                cpu_lines.append(f"- {policy} {scenario}: {cpu}")
    if cpu_lines:
        lines.append("")
        lines.append(
            "CPU during each scenario's (median) run: each of our processes and `others` "
            "(everything else on the machine) in % of one core; machine_busy and "
            "machine_steal in % of all cores:"
        )
        lines.extend(cpu_lines)
    return "\n".join(lines)


def _cell(value: Any, key: str) -> str:
    """One table cell: the figure, its runs' range when repeated, a mark if cut short."""
    if value is None:
        return "-"
    if not key:
        return f"{value}"
    figure = value.get(key)
    if figure is None:
        return "-"
    text = f"{figure:,}" if isinstance(figure, int) else f"{figure}"
    rates = value.get("runs_events_per_s", [])
    if key == "events_per_s" and len(rates) > 1:
        text += f" ({min(rates) / 1000:.0f}k-{max(rates) / 1000:.0f}k)"
    if key == "events_per_s" and value.get("hit_deadline"):
        text += " (deadline hit)"
    return text


if __name__ == "__main__":
    sys.exit(main())
