"""Runs a simulator's seeds as tests: the seeds are cut into chunks of consecutive seeds,
one test each (``chunks``; ``tests/xdist_units.py`` lets xdist put each chunk on either
worker), and a chunk runs every seed even after one failed, then fails naming every
failing seed with the command that replays it (shell_sim and coordinated_sim share it).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence

import pytest

from tests.sim.shell_sim import ShellSimFailure, Stats
from tests.xdist_units import seed_chunk_id

# A failing chunk shows this many failures in full (every failing seed gets its line).
FAILURES_IN_FULL = 3


def chunks(seeds: Sequence[int], size: int) -> list[list[int]]:
    """seeds cut into runs of at most size consecutive seeds."""
    return [list(seeds[i : i + size]) for i in range(0, len(seeds), size)]


def parametrize_chunks(
    metafunc: pytest.Metafunc, argname: str, seeds: Sequence[int], size: int
) -> None:
    """Parametrizes argname with the chunks of seeds, each id naming its seeds
    (``seeds-0-49``): a failing test says which seeds it ran."""
    parts = chunks(seeds, size)
    metafunc.parametrize(argname, parts, ids=[seed_chunk_id(part) for part in parts])


def run_seeds(
    name: str,
    seeds: Sequence[int],
    run_seed: Callable[[int], Stats],
    replay_command: Callable[[int], str],
) -> Stats:
    """Every seed in turn; then, if any failed, the test fails listing each failing seed
    with its replay command, and the first failures in full. Returns the seeds' summed
    counts (acknowledged publishes, epochs, crashes, disk failures, rotted log records and
    the faults they raised, snapshot installs)."""
    started = time.process_time()
    total = Stats()
    failures: list[tuple[int, str]] = []
    for seed in seeds:
        try:
            stats = run_seed(seed)
        except ShellSimFailure as exc:
            failures.append((seed, str(exc)))
            continue
        except Exception as exc:  # the shipped code or the harness raising fails the seed
            trace = "".join(traceback.format_exception(exc))
            failures.append((seed, f"seed {seed}: raised {exc!r}\n{trace}{replay_command(seed)}"))
            continue
        total.acked += stats.acked
        total.elections += stats.elections
        total.crashes += stats.crashes
        total.disk_failures += stats.disk_failures
        total.rotten_records += stats.rotten_records
        total.rot_faults += stats.rot_faults
        total.replacements += stats.replacements
        total.removals += stats.removals
        total.shutdowns += stats.shutdowns
        total.snapshots_begun += stats.snapshots_begun
        total.snapshots_finished += stats.snapshots_finished
    cpu = time.process_time() - started
    print(
        f"\n{name}: {len(seeds)} seeds ({len(failures)} failed) in {cpu:.1f} s CPU "
        f"({cpu / max(1, len(seeds)):.2f} s a seed): "
        f"{total.acked} publishes acknowledged, {total.elections} master epochs, "
        f"{total.crashes} crashes, {total.disk_failures} disk failures, "
        f"{total.rotten_records} log records rotted ({total.rot_faults} nodes reported it), "
        f"{total.replacements} machines replaced, {total.removals} nodes removed and added "
        f"back, {total.shutdowns} cluster shutdowns, "
        f"{total.snapshots_begun} snapshot installs begun ({total.snapshots_finished} "
        f"finished, {total.snapshots_cut_short} cut short)"
    )
    if failures:
        pytest.fail(failure_report(name, len(seeds), failures, replay_command), pytrace=False)
    return total


def failure_report(
    name: str,
    ran: int,
    failures: Sequence[tuple[int, str]],
    replay_command: Callable[[int], str],
) -> str:
    """Which seeds failed (each with its first line and replay command), then the first
    FAILURES_IN_FULL failures as they were raised."""
    lines = [f"{name}: {len(failures)} of {ran} seeds failed: {[s for s, _ in failures]}"]
    for seed, message in failures:
        first = message.splitlines()[0].removeprefix(f"seed {seed}: ") if message else ""
        lines.append(f"  seed {seed}: {first[:160]}\n    replay: {replay_command(seed)}")
    for seed, message in failures[:FAILURES_IN_FULL]:
        lines.append(f"\n--- seed {seed} ---\n{message}")
    if len(failures) > FAILURES_IN_FULL:
        lines.append(f"\n({len(failures) - FAILURES_IN_FULL} more failures: replay them above)")
    return "\n".join(lines)
