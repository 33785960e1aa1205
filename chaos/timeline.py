"""The timeline plot of a chaos run: faults, publish throughput, errors and unavailability.

One PNG, three panels sharing the time axis (seconds since the run started):

1. faults — one row per fault kind and target, a bar while the fault lasts (a kill lasts
   until the restart, a partition until it heals);
2. throughput — acknowledged events per second, per publish path (gateway, replicated,
   non-replicated), with the unavailability windows shaded;
3. errors — failed and indeterminate publishes per second.

Rates are counted in bins of horizon/300 seconds (at least 0.1 s), so a sub-second
failover shows in a short run and a long run stays readable.

Drawn with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from chaos.checker import (
    GAP_THRESHOLD_S_DEFAULT,
    fault_intervals,
    unavailability_windows,
)

# Colour per fault kind; unknown kinds get grey.
FAULT_COLOURS = {
    "kill": "#d62728",
    "pause": "#ff7f0e",
    "kill_replica": "#ff9896",
    "kill_coordinator": "#aec7e8",
    "pause_replica": "#ffbb78",
    "pause_coordinator": "#c49c94",
    "stop": "#98df8a",
    "stop_replica": "#dbdb8d",
    "stop_coordinator": "#9edae5",
    "partition": "#9467bd",
    "partition_replica": "#c5b0d5",
    "partition_coordinator": "#7f7f7f",
    "map_full": "#8c564b",
    "corrupt": "#e377c2",
    "slow_disk": "#bcbd22",
    "clock_jump": "#17becf",
}
PATH_COLOURS = {
    "gateway": "#1f77b4",
    "replicated": "#2ca02c",
    "non_replicated": "#ff7f0e",
    "gateway_unary": "#9467bd",
}


# A short run gets bins of at least this width; a long one about BINS_TARGET bins.
BIN_S_MIN = 0.1
BINS_TARGET = 300


def _bin_s(horizon: float) -> float:
    """The bin width: fine enough to show a sub-second failover in a short run."""
    return max(BIN_S_MIN, round(horizon / BINS_TARGET, 1))


def _rates(
    times: Sequence[float], weights: Sequence[int], horizon: float, bin_s: float
) -> tuple[list[float], list[float]]:
    """(bin starts, per-second rate in each bin) of weighted events at `times`."""
    count = int(horizon / bin_s) + 1
    bins = [0.0] * count
    for t, w in zip(times, weights, strict=True):
        bins[min(int(t / bin_s), count - 1)] += w
    return [i * bin_s for i in range(count)], [b / bin_s for b in bins]


def plot_timeline(
    records: Sequence[Mapping[str, Any]],
    png_path: Path,
    *,
    gap_threshold_s: float = GAP_THRESHOLD_S_DEFAULT,
) -> Path:
    """Draws the run's timeline into png_path; returns the path."""
    invokes = {int(r["id"]): r for r in records if r.get("type") == "invoke"}
    horizon = max((float(r["t"]) for r in records), default=1.0)
    ok: dict[str, tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
    errors: dict[str, tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
    for record in records:
        if record.get("type") != "complete":
            continue
        invoke = invokes.get(int(record["id"]))
        if invoke is None or invoke.get("op") != "publish":
            continue
        t = float(record["t"])
        if record.get("outcome") == "ok":
            times, weights = ok[str(invoke.get("path"))]
            times.append(t)
            weights.append(len(invoke.get("events") or ()))
        else:
            times, weights = errors[str(record.get("outcome"))]
            times.append(t)
            weights.append(1)

    faults = fault_intervals(records)
    rows = sorted({label for _, _, label in faults})
    figure, (ax_faults, ax_ok, ax_err) = plt.subplots(
        3,
        1,
        sharex=True,
        figsize=(12, 7.5),
        gridspec_kw={"height_ratios": [max(1.2, 0.35 * len(rows) + 0.6), 2.2, 1.4]},
    )
    seed = next((r.get("seed") for r in records if r.get("type") == "run"), None)
    figure.suptitle(f"chaos run seed={seed}: faults, throughput and errors")

    for start, end, label in faults:
        kind = label.split(" ", 1)[0]
        row = rows.index(label)
        width = max(end - start, horizon / 400)  # an instant fault still shows
        ax_faults.broken_barh(
            [(start, width)], (row - 0.4, 0.8), color=FAULT_COLOURS.get(kind, "#7f7f7f")
        )
    ax_faults.set_yticks(range(len(rows)), rows if rows else [])
    ax_faults.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax_faults.set_ylabel("faults")
    if not rows:
        ax_faults.text(0.5, 0.5, "no faults", transform=ax_faults.transAxes, ha="center")

    bin_s = _bin_s(horizon)
    for path, (times, weights) in sorted(ok.items()):
        starts, rates = _rates(times, weights, horizon, bin_s)
        ax_ok.step(
            starts,
            rates,
            where="post",
            label=path,
            color=PATH_COLOURS.get(path),
        )
    windows = unavailability_windows(records, gap_threshold_s)
    for i, window in enumerate(windows):
        ax_ok.axvspan(
            window.start,
            window.end,
            color="#d62728",
            alpha=0.15,
            label=f"unavailable > {gap_threshold_s:g} s" if i == 0 else None,
        )
    ax_ok.set_ylabel(f"acked events/s\n({bin_s:g} s bins)")
    if ok or windows:
        ax_ok.legend(loc="upper right", fontsize="small")

    for outcome, colour in (("fail", "#d62728"), ("indeterminate", "#9467bd")):
        times, weights = errors.get(outcome, ([], []))
        starts, rates = _rates(times, weights, horizon, bin_s)
        ax_err.step(
            starts,
            rates,
            where="post",
            label=outcome,
            color=colour,
        )
    ax_err.set_ylabel("publishes/s\nnot ok")
    ax_err.set_xlabel("seconds since the run started")
    ax_err.legend(loc="upper right", fontsize="small")
    ax_err.set_xlim(0, max(horizon, 1.0))
    for axis in (ax_faults, ax_ok, ax_err):
        axis.grid(axis="x", alpha=0.3)

    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path
