"""The benchmark report: figures and samples in, report.json + report.md + PNG plots out.

`bench.suite` measures; this module only summarizes and renders, so it can be tested on
synthetic samples. The raw results it takes (see `assemble`) hold every sample the plots
need: per-publish latencies per sync policy, every failover trial's gap. Percentiles are
nearest-rank (`bench.single_node.percentile`): p50 of [1, 2, 3, 4, 5] is 3, p90 of 1..10
is 9, and every figure reported is one that was measured.

Every figure is specific to the machine it ran on (2 shared cores run the client and all
seven service processes), so the Markdown and each plot say so: read them as ratios
(policy against policy, idle against loaded), not as a cluster's capacity.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only, also in CI and over ssh

import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen first
from matplotlib.ticker import MaxNLocator

from bench import latency
from bench.consumers import section as consumer_section
from bench.single_node import percentile

REPORT_VERSION = 1
# Plot files, in the order the Markdown shows them.
PLOTS = {
    "throughput": "throughput.png",
    "latency_cdf": "latency_cdf.png",
    "failover": "failover.png",
    "fault_gaps": "fault_gaps.png",
    "memory": "memory.png",
}
CAVEAT = (
    "machine-specific: the client and every service process share this machine's cores; "
    "read as ratios (policy against policy), not as capacity"
)
MIB = 2**20


# --- the math


def summarize(samples: Iterable[float]) -> dict[str, Any]:
    """count, min, p50, p90, p99, max and mean of samples (None for each when empty)."""
    ordered = sorted(samples)
    if not ordered:
        return {
            "count": 0,
            "min": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
            "mean": None,
        }
    return {
        "count": len(ordered),
        "min": ordered[0],
        "p50": percentile(ordered, 0.50),
        "p90": percentile(ordered, 0.90),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1],
        "mean": round(sum(ordered) / len(ordered), 3),
    }


def cdf(samples: Iterable[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF as steps: ascending values and the fraction at or below each.

    Equal values collapse into one step, so the fraction of [1, 2, 2, 4] at 2 is 0.75.
    """
    ordered = sorted(samples)
    xs: list[float] = []
    ys: list[float] = []
    for i, value in enumerate(ordered, start=1):
        if xs and xs[-1] == value:
            ys[-1] = i / len(ordered)
        else:
            xs.append(value)
            ys.append(i / len(ordered))
    return xs, ys


# --- assembling


def assemble(
    *,
    started_at: str,
    seconds: float,
    machine: dict[str, Any],
    load_average_end: list[float] | None,
    background_load_pct_of_core: float | None,
    setup: dict[str, Any],
    policies: dict[str, dict[str, Any]],
    catch_up: dict[str, Any] | None,
    failover: dict[str, Any] | None,
    fault_gaps: dict[str, Any] | None = None,
    consumers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report: what was measured (with samples) plus a `summary` of headline figures.

    policies: per sync policy, the scenarios' figures as `bench.suite` returns them
    (`pipelined_publish`, `one_at_a_time` with `latency_ms_samples`, `subscribe`,
    `memory` with `idle` and `after_load`); failover: `bench.failover.run`'s figures
    (`all_ms`); catch_up: `bench.replicated.catch_up`'s plus the policy it ran under;
    fault_gaps: `bench.fault_gaps.run`'s figures (per kind and path, every trial's);
    consumers: `bench.consumers.run`'s figures (shared subscriptions, reads from replicas).
    """
    summary: dict[str, Any] = {
        "pipelined_publish_events_per_s": {},
        "pipelined_publish_runs_events_per_s": {},
        "one_at_a_time_events_per_s": {},
        "publish_latency_ms": {},
        # The asyncio client (squall.aio) measured in the same run, and its rate over the
        # threaded client's (1.0: as fast).
        "aio_pipelined_publish_events_per_s": {},
        "aio_one_at_a_time_events_per_s": {},
        "aio_over_threaded_pipelined": {},
        "aio_over_threaded_one_at_a_time": {},
        "subscribe_events_per_s": {},
        "memory_bytes": {},
        "catch_up_events_per_s": catch_up.get("events_per_s") if catch_up else None,
        "failover_ms": summarize(failover["all_ms"]) if failover else None,
        "fault_gaps": gap_summary(fault_gaps) if fault_gaps else None,
    }
    for policy, figures in policies.items():
        pipelined = figures.get("pipelined_publish") or {}
        summary["pipelined_publish_events_per_s"][policy] = pipelined.get("events_per_s")
        summary["pipelined_publish_runs_events_per_s"][policy] = pipelined.get(
            "runs_events_per_s", []
        )
        one = figures.get("one_at_a_time") or {}
        summary["one_at_a_time_events_per_s"][policy] = one.get("events_per_s")
        summary["publish_latency_ms"][policy] = summarize(one.get("latency_ms_samples", []))
        aio = figures.get("aio") or {}
        aio_pipelined = (aio.get("pipelined_publish") or {}).get("events_per_s")
        aio_one = (aio.get("one_at_a_time") or {}).get("events_per_s")
        summary["aio_pipelined_publish_events_per_s"][policy] = aio_pipelined
        summary["aio_one_at_a_time_events_per_s"][policy] = aio_one
        summary["aio_over_threaded_pipelined"][policy] = _ratio(
            aio_pipelined, pipelined.get("events_per_s")
        )
        summary["aio_over_threaded_one_at_a_time"][policy] = _ratio(
            aio_one, one.get("events_per_s")
        )
        summary["subscribe_events_per_s"][policy] = (figures.get("subscribe") or {}).get(
            "events_per_s"
        )
        summary["memory_bytes"][policy] = memory_table(figures.get("memory") or {})
    return {
        "report_version": REPORT_VERSION,
        "started_at": started_at,
        "seconds": round(seconds, 1),
        "caveat": CAVEAT,
        "machine": machine,
        "load_average_start": machine.get("load_average"),
        "load_average_end": load_average_end,
        "background_load_pct_of_core": background_load_pct_of_core,
        "setup": setup,
        "summary": summary,
        "policies": policies,
        "catch_up": catch_up,
        "failover": failover,
        "fault_gaps": fault_gaps,
        "consumers": consumers,
        "plots": dict(PLOTS),
    }


def gap_summary(gaps: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per fault kind and path: trials, first-ack and longest-gap statistics (ms), how
    many trials did not recover or recovered only after the heal, and whether the aim
    (p50 and max of both figures, every trial recovered) is met."""
    p50_aim, max_aim = gaps.get("aim_p50_ms", 500.0), gaps.get("aim_max_ms", 1000.0)
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for kind, figures in (gaps.get("kinds") or {}).items():
        table[kind] = {}
        for path, row in (figures.get("paths") or {}).items():
            first = summarize(row.get("first_ack_ms") or [])
            longest = summarize(row.get("longest_gap_ms") or [])
            trials = figures.get("trials", 0)
            met = (
                trials > 0
                and not row.get("not_recovered")
                and all(
                    stats["count"] and stats["p50"] <= p50_aim and stats["max"] <= max_aim
                    for stats in (first, longest)
                )
            )
            table[kind][path] = {
                "trials": trials,
                "first_ack_ms": first,
                "longest_gap_ms": longest,
                "not_recovered": row.get("not_recovered", 0),
                "after_heal": row.get("after_heal", 0),
                "meets_aim": bool(met),
            }
    return table


def memory_table(memory: dict[str, Any]) -> dict[str, dict[str, int | None]]:
    """Per service: RSS at idle, RSS after the load (and how much of it is file-backed:
    LMDB's map for a replica), and peak RSS; bytes, None where unknown or gone."""
    idle = memory.get("idle") or {}
    after = memory.get("after_load") or {}
    table: dict[str, dict[str, int | None]] = {}
    for service in sorted(set(idle) | set(after)):
        before, later = idle.get(service) or {}, after.get(service) or {}
        peaks = [p for p in (before.get("peak_rss_bytes"), later.get("peak_rss_bytes")) if p]
        table[service] = {
            "idle_rss_bytes": before.get("rss_bytes"),
            "after_load_rss_bytes": later.get("rss_bytes"),
            "after_load_rss_file_bytes": later.get("rss_file_bytes"),
            "peak_rss_bytes": max(peaks) if peaks else None,
        }
    return table


# --- writing


def write(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Writes report.json, the PNG plots and report.md into out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    drawn = plot_all(report, out_dir)
    paths.update({name: out_dir / file for name, file in drawn.items()})
    paths["markdown"] = out_dir / "report.md"
    paths["markdown"].write_text(markdown(report, drawn))
    return paths


def point_latest(results_dir: Path, run_dir: Path, name: str = "latest") -> Path:
    """Points results_dir/name at run_dir (a relative symlink, replaced atomically)."""
    link = results_dir / name
    temp = results_dir / f".{name}.tmp"
    temp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(run_dir, results_dir), temp)
    os.replace(temp, link)
    return link


# --- Markdown


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and digits:
        return f"{value:,.{digits}f}"
    return f"{round(value):,}" if isinstance(value, (int, float)) else str(value)


def _ms(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value >= 100 else f"{value:.2f}"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _ratio(numerator: Any, denominator: Any) -> float | None:
    """numerator / denominator to two places, None when either is missing or zero."""
    if not numerator or not denominator:
        return None
    return round(float(numerator) / float(denominator), 2)


def markdown(report: dict[str, Any], plots: dict[str, str]) -> str:
    """The report as Markdown: tables of the summary, the plots embedded, the machine."""
    summary = report["summary"]
    policies = list(report["policies"])
    setup = report["setup"]
    lines = [
        f"# Squall benchmark report ({report['started_at']})",
        "",
        f"> Figures are {CAVEAT}. Load average at start {_load(report['load_average_start'])}, "
        f"at end {_load(report['load_average_end'])} (on {_cores(report['machine'])} cores).",
        "",
        f"Reproduce: `make bench` (this run: `{setup.get('command', 'make bench')}`, "
        f"{report['seconds']:.0f} s). See bench/README.md for what each figure means.",
        "",
        "## Machine",
        "",
        *_machine_table(report),
        "",
        "## Setup",
        "",
        f"{setup.get('nodes', 3)} nodes from `{setup.get('template')}` on loopback, one "
        f"gateway, {setup.get('event_bytes')}-byte events, acks `{setup.get('acks')}`; per "
        "policy a fresh cluster with `master_sync` and `replica_sync` both set to it. The "
        "client is this bench process, through the gateway.",
        "",
    ]
    sizes = setup.get("sizes", {})
    if sizes:
        lines.append("Sizes: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()) + ".")
        lines.append("")
    lines += [
        "## Publish throughput and consume rate per sync policy",
        "",
        "| events/s | " + " | ".join(policies) + " |",
        "|---|" + "---:|" * len(policies),
        _row(
            f"pipelined publish (batches of {setup.get('batch_events')}, median of runs)",
            [_rate_cell(summary, p) for p in policies],
        ),
        _row(
            "one at a time (each publish waits for its receipt)",
            [
                _num(summary["one_at_a_time_events_per_s"].get(p))
                + _capped(report["policies"][p].get("one_at_a_time"))
                for p in policies
            ],
        ),
        _row(
            "pipelined publish, asyncio client `squall.aio` (median of runs; x threaded)",
            [
                _num(summary.get("aio_pipelined_publish_events_per_s", {}).get(p))
                + _times(summary.get("aio_over_threaded_pipelined", {}).get(p))
                for p in policies
            ],
        ),
        _row(
            "one at a time, asyncio client (x threaded)",
            [
                _num(summary.get("aio_one_at_a_time_events_per_s", {}).get(p))
                + _times(summary.get("aio_over_threaded_one_at_a_time", {}).get(p))
                for p in policies
            ],
        ),
        _row(
            "consume: subscribe from the earliest offset, message by message (median of runs)",
            [
                _num(summary["subscribe_events_per_s"].get(p))
                + _capped(report["policies"][p].get("subscribe"))
                for p in policies
            ],
        ),
        _row(
            "other work on the machine during the median pipelined run (% of one core)",
            [_others(report["policies"][p].get("pipelined_publish")) for p in policies],
        ),
        "",
    ]
    lines += _image(plots, "throughput", "Publish and consume rates per sync policy")
    lines += [
        "## Publish latency (one at a time)",
        "",
        "Each `publish()` call timed from the call to its receipt: client -> gateway -> "
        "master -> slaves -> master -> gateway -> client.",
        "",
        "| ms | " + " | ".join(policies) + " |",
        "|---|" + "---:|" * len(policies),
    ]
    for key in ("p50", "p90", "p99", "max"):
        lines.append(_row(key, [_ms(summary["publish_latency_ms"][p][key]) for p in policies]))
    lines.append(
        _row("samples", [_num(summary["publish_latency_ms"][p]["count"]) for p in policies])
    )
    lines.append("")
    lines += _image(plots, "latency_cdf", "Publish latency CDF per sync policy")
    lines += ["## Catch-up", ""]
    catch = report.get("catch_up")
    if catch:
        lines.append(
            f"A slave killed (kill -9), {catch['events_behind']:,} events published, the slave "
            f"restarted: it caught up in {catch['seconds_from_restart']} s from its restart, "
            f"**{_num(catch['events_per_s'])} events/s** (policy {catch.get('policy')}; "
            f"{'by snapshot' if catch.get('by_snapshot') else 'from the log'}; the time "
            "includes the node's start and its rejoining the group)."
        )
    else:
        lines.append("Not measured in this run.")
    lines += _latency_section(report)
    lines += ["", "## Failover", ""]
    fail = report.get("failover")
    gap = summary.get("failover_ms")
    if fail and gap and gap["count"]:
        lines += [
            "kill -9 of the master node's processes to another node NORMAL as coordinator "
            f"with its replica master (polled every {fail.get('poll_ms')} ms), default "
            "timeouts (heartbeat 100 ms, member timeout 400 ms).",
            "",
            "| trials | min ms | p50 ms | p90 ms | max ms |",
            "|---:|---:|---:|---:|---:|",
            f"| {gap['count']} | {_ms(gap['min'])} | {_ms(gap['p50'])} | {_ms(gap['p90'])} "
            f"| {_ms(gap['max'])} |",
            "",
        ]
        lines += _image(plots, "failover", "Failover gap distribution")
    else:
        lines += ["Not measured in this run.", ""]
    lines += _gap_section(report, plots)
    lines += consumer_section(report.get("consumers"))
    lines += ["## Memory per service", ""]
    for policy in policies:
        table = summary["memory_bytes"][policy]
        if not table:
            continue
        lines += [
            f"{policy} cluster (MiB; RSS from `/proc/PID/status` VmRSS, peak is VmHWM; "
            "file-backed is RssFile, for a replica mostly LMDB's memory-mapped store, page "
            "cache the kernel can reclaim):",
            "",
            "| service | idle RSS | after load RSS | of which file-backed | peak RSS |",
            "|---|---:|---:|---:|---:|",
        ]
        for service, row in table.items():
            lines.append(
                f"| {service} | {_mib(row['idle_rss_bytes'])} | "
                f"{_mib(row['after_load_rss_bytes'])} | "
                f"{_mib(row.get('after_load_rss_file_bytes'))} | {_mib(row['peak_rss_bytes'])} |"
            )
        lines.append("")
    lines += _image(plots, "memory", "RSS per service, idle and after load")
    return "\n".join(lines).rstrip() + "\n"


def _latency_section(report: dict[str, Any]) -> list[str]:
    """One publish at a time, concurrent publishers, delivery and the per-stage budget."""
    measured = {p: f["latency"] for p, f in report["policies"].items() if f.get("latency")}
    if not measured:
        return []
    return [
        "",
        "## Latency: one at a time, concurrent publishers, delivery (`bench/latency.py`)",
        "",
        "Against the floor measured in this run: one bare gRPC round trip between two "
        "Python processes. Each thread publishes one event at a time, with its own "
        'publisher or all sharing one ("before": one request per call, the path '
        "`publish()` took before concurrent callers joined their events).",
        "",
        latency.table(measured),
    ]


def _gap_section(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    """The publisher-visible gap per fault kind and path, the aim, the read-back."""
    lines = ["## Publisher-visible gap per fault kind", ""]
    gaps = report.get("fault_gaps")
    table = report["summary"].get("fault_gaps")
    if not gaps or not table:
        return [*lines, "Not measured in this run.", ""]
    read = gaps.get("read_back") or {}
    lines += [
        f"**Aim: {gaps.get('aim')}; zero acknowledged events lost.** Three publishers at "
        "once, one per path (through the gateway, a replicated proxy, a non-replicated "
        "proxy), one event at a time, while the master (n1) is hit; each fault held "
        f"{gaps.get('hold_s')} s, then healed (restart / SIGCONT). *first ack*: from the "
        "fault to the first receipt of a publish sent after it; *longest gap*: the longest "
        "interval with no receipt from the fault to the first receipt after the heal "
        "(lead_back: the restarted n1 taking the role back, from its restart). *after "
        "heal*: trials whose first receipt came only after the heal (no failover: the gap "
        f"is the fault's length); *not recovered*: none within {gaps.get('recover_s')} s "
        "of the heal. See bench/fault_gaps.py."
        + (
            f" Each kind's log was first lengthened by {gaps['prefill_events']:,} entries "
            "(`--gap-prefill`)."
            if gaps.get("prefill_events")
            else ""
        ),
        "",
        "| fault kind | path | trials | first ack p50 / p90 / max ms "
        "| longest gap p50 / p90 / max ms | after heal | not recovered | aim |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for kind, paths in table.items():
        for path, row in paths.items():
            first, longest = row["first_ack_ms"], row["longest_gap_ms"]
            lines.append(
                f"| {kind} | {path} | {row['trials']} | "
                f"{_ms(first['p50'])} / {_ms(first['p90'])} / {_ms(first['max'])} | "
                f"{_ms(longest['p50'])} / {_ms(longest['p90'])} / {_ms(longest['max'])} | "
                f"{row['after_heal']} | {row['not_recovered']} | "
                f"{'met' if row['meets_aim'] else '**missed**'} |"
            )
    lines += [
        "",
        f"Read back from the earliest offset: {_num(read.get('acknowledged'))} acknowledged "
        f"events, **{_num(read.get('lost'))} lost** (not at their receipt's offset with their "
        f"payload), {_num(read.get('stored_twice'))} stored twice.",
    ]
    errors = [
        f"{kind}: {figures['error']}"
        for kind, figures in (gaps.get("kinds") or {}).items()
        if figures.get("error")
    ]
    lines += [f"- stopped early: {e}" for e in errors]
    lines.append("")
    lines += _image(plots, "fault_gaps", "Publisher-visible gap per fault kind and path")
    return lines


def _times(ratio: Any) -> str:
    return "" if ratio is None else f" ({ratio:.2f}x)"


def _row(label: str, cells: Sequence[str]) -> str:
    return f"| {label} | " + " | ".join(cells) + " |"


def _capped(figures: dict[str, Any] | None) -> str:
    """A mark for a run its deadline cut short: its rate holds, its count is smaller."""
    return " (deadline hit)" if figures and figures.get("hit_deadline") else ""


def _others(figures: dict[str, Any] | None) -> str:
    others = ((figures or {}).get("cpu_pct") or {}).get("others")
    return "-" if others is None else f"{others:.0f}%"


def _rate_cell(summary: dict[str, Any], policy: str) -> str:
    text = _num(summary["pipelined_publish_events_per_s"].get(policy))
    runs = summary["pipelined_publish_runs_events_per_s"].get(policy) or []
    if len(runs) > 1:
        text += f" ({_num(min(runs))}-{_num(max(runs))})"
    return text


def _image(plots: dict[str, str], name: str, title: str) -> list[str]:
    if name not in plots:
        return []
    return [f"![{title}]({plots[name]})", ""]


def _load(load: list[float] | None) -> str:
    return "unknown" if not load else " / ".join(f"{v:.2f}" for v in load) + " (1/5/15 min)"


def _cores(machine: dict[str, Any]) -> str:
    return str(machine.get("cpu_cores_usable") or machine.get("cpu_cores_online") or "?")


def _machine_table(report: dict[str, Any]) -> list[str]:
    described = report["machine"]
    packages = described.get("packages") or {}
    disk = described.get("disk") or {}
    git = described.get("git") or {}
    memory = described.get("memory_bytes")
    commit = git.get("commit")
    rows = [
        (
            "CPU",
            f"{described.get('cpu_model') or '?'}{' (VM)' if described.get('virtualized') else ''}",
        ),
        ("cores", _cores(described)),
        ("RAM", f"{memory / 2**30:.1f} GiB" if memory else "?"),
        ("kernel", described.get("kernel") or "?"),
        ("Python", described.get("python") or "?"),
        (
            "grpcio / protobuf / lmdb",
            " / ".join(str(packages.get(p)) for p in ("grpcio", "protobuf", "lmdb")),
        ),
        (
            "disk",
            f"{disk.get('kind') or '?'} ({disk.get('filesystem') or '?'}), "
            f"fsync of 4 KiB p50 {disk.get('fsync_ms_p50')} ms"
            if disk
            else "?",
        ),
        (
            "git commit",
            f"`{commit[:12]}`{' (with uncommitted changes)' if git.get('dirty') else ''}"
            if commit
            else "?",
        ),
        ("load average at start", _load(report.get("load_average_start"))),
        ("load average at end", _load(report.get("load_average_end"))),
    ]
    background = report.get("background_load_pct_of_core")
    if background is not None:
        rows.append(("other work before the run", f"{background:.0f}% of one core"))
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


# --- plots


def _footnote(fig: Any, report: dict[str, Any]) -> None:
    """Every plot names its machine and says it is machine-specific."""
    described = report["machine"]
    load = report.get("load_average_start")
    fig.text(
        0.01,
        0.01,
        f"{described.get('cpu_model') or 'unknown CPU'}, {_cores(described)} cores, "
        f"load {load[0] if load else '?'} at start. Machine-specific: read as ratios.",
        fontsize=7,
        color="dimgray",
    )


def plot_all(report: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Draws every plot the report has data for; returns name -> file name."""
    drawn: dict[str, str] = {}
    summary = report["summary"]
    if report["policies"]:
        _plot_throughput(report, out_dir / PLOTS["throughput"])
        drawn["throughput"] = PLOTS["throughput"]
    if any(summary["publish_latency_ms"][p]["count"] for p in report["policies"]):
        _plot_latency_cdf(report, out_dir / PLOTS["latency_cdf"])
        drawn["latency_cdf"] = PLOTS["latency_cdf"]
    if report.get("failover") and report["failover"].get("all_ms"):
        _plot_failover(report, out_dir / PLOTS["failover"])
        drawn["failover"] = PLOTS["failover"]
    if summary.get("fault_gaps"):
        _plot_fault_gaps(report, out_dir / PLOTS["fault_gaps"])
        drawn["fault_gaps"] = PLOTS["fault_gaps"]
    if any(summary["memory_bytes"][p] for p in report["policies"]):
        _plot_memory(report, out_dir / PLOTS["memory"])
        drawn["memory"] = PLOTS["memory"]
    return drawn


def _plot_throughput(report: dict[str, Any], path: Path) -> None:
    summary = report["summary"]
    policies = list(report["policies"])
    panels = (
        ("pipelined publish", "pipelined_publish_events_per_s"),
        ("one at a time", "one_at_a_time_events_per_s"),
        ("consume (subscribe)", "subscribe_events_per_s"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4))
    for ax, (title, key) in zip(axes, panels, strict=True):
        values = [summary[key].get(p) or 0 for p in policies]
        bars = ax.bar(policies, values, color=["#4c72b0", "#dd8452", "#55a868"][: len(values)])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        ax.set_title(title)
        ax.set_ylabel("events/s")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("3 nodes, 100-byte events, per sync policy (master and replicas)")
    _footnote(fig, report)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_latency_cdf(report: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, figures in report["policies"].items():
        samples = (figures.get("one_at_a_time") or {}).get("latency_ms_samples") or []
        if not samples:
            continue
        xs, ys = cdf(samples)
        stats = report["summary"]["publish_latency_ms"][policy]
        ax.step(
            xs,
            ys,
            where="post",
            label=f"{policy}: p50 {_ms(stats['p50'])}, p99 {_ms(stats['p99'])} ms",
        )
    ax.set_xscale("log")
    ax.set_xlabel("publish latency, ms (log scale)")
    ax.set_ylabel("fraction of publishes at or below")
    ax.set_ylim(0, 1.01)
    for level in (0.5, 0.9, 0.99):
        ax.axhline(level, color="lightgray", linewidth=0.8, linestyle="--")
    ax.grid(True, which="both", axis="x", color="whitesmoke")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("One-at-a-time publish latency CDF, 3 nodes")
    _footnote(fig, report)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_failover(report: dict[str, Any], path: Path) -> None:
    gaps = report["failover"]["all_ms"]
    stats = report["summary"]["failover_ms"]
    fig, (hist, curve) = plt.subplots(1, 2, figsize=(10, 4))
    hist.hist(gaps, bins=min(20, max(1, len(gaps))), color="#4c72b0", edgecolor="white")
    hist.set_xlabel("kill -9 to a new normal master, ms")
    hist.set_ylabel("trials")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.set_title(f"{len(gaps)} trials: p50 {_ms(stats['p50'])}, max {_ms(stats['max'])} ms")
    xs, ys = cdf(gaps)
    curve.step(xs, ys, where="post", color="#4c72b0")
    curve.set_xlabel("ms")
    curve.set_ylabel("fraction of trials at or below")
    curve.set_ylim(0, 1.01)
    curve.set_title("CDF")
    fig.suptitle("Failover gap, 3 nodes, default timeouts")
    _footnote(fig, report)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_fault_gaps(report: dict[str, Any], path: Path) -> None:
    """Longest gap per kind and path: p50 bars with the max marked, the aim's lines."""
    table = report["summary"]["fault_gaps"]
    gaps = report["fault_gaps"]
    kinds = list(table)
    paths = list(gaps.get("paths") or next(iter(table.values()), {}))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(1, len(paths))
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    for i, name in enumerate(paths):
        xs = [k + (i - (len(paths) - 1) / 2) * width for k in range(len(kinds))]
        rows = [table[kind].get(name) or {} for kind in kinds]
        p50 = [(r.get("longest_gap_ms") or {}).get("p50") or 0 for r in rows]
        top = [(r.get("longest_gap_ms") or {}).get("max") or 0 for r in rows]
        ax.bar(xs, p50, width, label=f"{name} p50", color=colors[i % len(colors)])
        ax.scatter(xs, top, marker="_", s=200, color="black", zorder=3)
    ax.axhline(gaps.get("aim_p50_ms", 500), color="gray", linestyle="--", linewidth=0.8)
    ax.axhline(gaps.get("aim_max_ms", 1000), color="red", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
    ax.set_ylabel("longest interval without a receipt, ms (log)")
    ax.set_yscale("symlog", linthresh=100)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(
        "Publisher-visible gap per fault kind (bars p50, dashes max; aim p50 500 / max 1000 ms)"
    )
    _footnote(fig, report)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_memory(report: dict[str, Any], path: Path) -> None:
    tables = {p: t for p, t in report["summary"]["memory_bytes"].items() if t}
    fig, axes = plt.subplots(len(tables), 1, figsize=(10, 3 * len(tables)), squeeze=False)
    series = (
        ("idle", "idle_rss_bytes", "#8da0cb"),
        ("after load", "after_load_rss_bytes", "#fc8d62"),
        ("peak", "peak_rss_bytes", "#66c2a5"),
    )
    width = 0.27
    for ax, (policy, table) in zip(axes[:, 0], tables.items(), strict=True):
        services = list(table)
        for i, (label, key, color) in enumerate(series):
            values = [(table[s][key] or 0) / MIB for s in services]
            ax.bar(
                [x + (i - 1) * width for x in range(len(services))],
                values,
                width,
                label=label,
                color=color,
            )
        ax.set_xticks(range(len(services)), services, fontsize=8)
        ax.set_ylabel("MiB")
        ax.set_title(f"{policy} cluster", fontsize=10)
        # Headroom above the tallest bar for the legend, so it hides none of them.
        tallest = max((row["peak_rss_bytes"] or 0) / MIB for row in table.values())
        ax.set_ylim(0, max(1.0, tallest) * 1.3)
        ax.legend(fontsize=8, loc="upper left", ncol=3)
    fig.suptitle("RSS per service process")
    _footnote(fig, report)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
