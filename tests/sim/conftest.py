"""Options for the simulators: how many seeds, or one seed to replay.

``--sim-seeds=N`` runs election seeds 0..N-1 (default 1000; ``make sim SEEDS=N``).
``--repl-seeds=N`` runs replication seeds 0..N-1 (each runs the shipped replica driver
and store of every node); when it is not given, the replication count is ``--sim-seeds``
(1000 by default, so ``make test`` runs 1000 of each), and ``make sim SEEDS=N`` scales
both. ``--sim-seed=S`` (or the ``SEED`` environment variable, which ``make sim SEED=S``
exports) replays one seed in both. ``--shell-seeds=N`` (or ``$SHELL_SEEDS``) runs seeds
0..N-1 of the shipped-shell simulator (``shell_sim.py``, default ``SHELL_SEEDS_DEFAULT``,
what fits in ``make test``); ``SEED`` replays one there too. ``--coord-seeds=N`` (or
``$COORD_SEEDS``) does the same for the whole-node simulator (``coordinated_sim.py``,
default ``COORD_SEEDS_DEFAULT``).
"""

from __future__ import annotations

import os

import pytest

DEFAULT_SEEDS = 1000
# Shell simulator seeds in make test: 0.3-0.4 s of CPU each, 30-40 s in all.
SHELL_SEEDS_DEFAULT = 100
# Whole-node (coordinator + replica) simulator seeds in make test: about 0.3 s of CPU each.
COORD_SEEDS_DEFAULT = 200
# Replication seeds per election seed when --repl-seeds is not given.
REPL_SEEDS_PER_SIM_SEED = 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register --sim-seeds and --sim-seed."""
    group = parser.getgroup("sim", "deterministic simulation")
    group.addoption(
        "--sim-seeds",
        type=int,
        default=DEFAULT_SEEDS,
        help=f"number of simulator seeds to run (default {DEFAULT_SEEDS})",
    )
    group.addoption(
        "--sim-seed",
        type=int,
        default=None,
        help="run only this seed (replay a failure); also read from $SEED",
    )
    group.addoption(
        "--repl-seeds",
        type=int,
        default=None,
        help="number of replication simulator seeds (default: as many as --sim-seeds)",
    )
    group.addoption(
        "--shell-seeds",
        type=int,
        default=None,
        help=f"number of shipped-shell simulator seeds (default $SHELL_SEEDS or "
        f"{SHELL_SEEDS_DEFAULT})",
    )
    group.addoption(
        "--coord-seeds",
        type=int,
        default=None,
        help=f"number of whole-node simulator seeds (default $COORD_SEEDS or "
        f"{COORD_SEEDS_DEFAULT})",
    )


def _replayed_seed(request: pytest.FixtureRequest) -> int | None:
    """The one seed to replay (--sim-seed or $SEED), if any."""
    single = request.config.getoption("sim_seed", default=None)
    if single is None and os.environ.get("SEED", "").strip():
        single = int(os.environ["SEED"])
    return None if single is None else int(single)


@pytest.fixture
def sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The seeds to run: one replayed seed, or 0..N-1."""
    single = _replayed_seed(request)
    if single is not None:
        return [single]
    count = request.config.getoption("sim_seeds", default=DEFAULT_SEEDS)
    return list(range(int(count)))


@pytest.fixture
def repl_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The replication simulator's seeds: one replayed seed, or 0..N-1."""
    single = _replayed_seed(request)
    if single is not None:
        return [single]
    count = request.config.getoption("repl_seeds", default=None)
    if count is None:
        sim = int(request.config.getoption("sim_seeds", default=DEFAULT_SEEDS))
        count = max(1, round(sim * REPL_SEEDS_PER_SIM_SEED))
    return list(range(int(count)))


@pytest.fixture
def shell_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The shipped-shell simulator's seeds: one replayed seed, or 0..N-1."""
    single = _replayed_seed(request)
    if single is not None:
        return [single]
    count = request.config.getoption("shell_seeds", default=None)
    if count is None:
        count = int(os.environ.get("SHELL_SEEDS", "").strip() or SHELL_SEEDS_DEFAULT)
    return list(range(int(count)))


@pytest.fixture
def coord_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The whole-node simulator's seeds: one replayed seed, or 0..N-1."""
    single = _replayed_seed(request)
    if single is not None:
        return [single]
    count = request.config.getoption("coord_seeds", default=None)
    if count is None:
        count = int(os.environ.get("COORD_SEEDS", "").strip() or COORD_SEEDS_DEFAULT)
    return list(range(int(count)))
