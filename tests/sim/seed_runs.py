"""Runs a simulator's seeds as one test: a failing seed fails it with its replay command,
and the totals of the seeds that ran are printed (shell_sim and coordinated_sim share it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from tests.sim.shell_sim import ShellSimFailure, Stats


def run_seeds(
    name: str,
    seeds: Sequence[int],
    run_seed: Callable[[int], Stats],
    replay_command: Callable[[int], str],
) -> None:
    """Every seed in turn; the first failure ends the test."""
    if not seeds:
        pytest.skip("no seed of this part (one seed replayed)")
    started = time.process_time()
    total = Stats()
    for seed in seeds:
        try:
            stats = run_seed(seed)
        except ShellSimFailure as exc:
            pytest.fail(str(exc), pytrace=False)
        except Exception as exc:  # the shipped code or the harness raising fails the seed
            raise AssertionError(f"seed {seed} raised {exc!r}\n{replay_command(seed)}") from exc
        total.acked += stats.acked
        total.elections += stats.elections
        total.crashes += stats.crashes
        total.disk_failures += stats.disk_failures
    cpu = time.process_time() - started
    print(
        f"\n{name}: {len(seeds)} seeds in {cpu:.1f} s CPU ({cpu / len(seeds):.2f} s a seed): "
        f"{total.acked} publishes acknowledged, {total.elections} master epochs, "
        f"{total.crashes} crashes, {total.disk_failures} disk failures"
    )
