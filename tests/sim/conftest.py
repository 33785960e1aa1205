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

The shell and whole-node seeds run as tests of ``SHELL_CHUNK_SEEDS`` / ``COORD_CHUNK_SEEDS``
consecutive seeds each (parameters ``shell_chunk`` / ``coord_chunk``, ids ``seeds-A-B``),
which ``make test``'s two workers share (``tests/xdist_units.py``).
"""

from __future__ import annotations

import os

import pytest

DEFAULT_SEEDS = 1000
# Shell simulator seeds in make test: 0.3-0.4 s of CPU each, 30-40 s in all.
SHELL_SEEDS_DEFAULT = 100
# Whole-node (coordinator + replica) simulator seeds in make test: 0.5-0.7 s of CPU each
# since machine replacement, shutdowns and node removal (2026-11-30), 540 of the
# simulators' 745 s of CPU at 800 seeds (2026-12-01). 400: the simulators and the
# real-process tests share CI's two cores, which the whole run keeps busy (the
# real-process tests took 973 s alone and 1,109 s beside 600 seeds), and it must stay
# under 20 minutes (scripts/test_suites.sh). The same seeds run in every CI run, so they
# guard against regressions; bug hunting runs thousands of new ones by hand (`make sim`,
# COORD_SEEDS=N, SEED=S; docs/status.md lists the ranges run).
COORD_SEEDS_DEFAULT = 400
# Seeds per test (a unit either worker takes): about 6 s of CPU for the whole-node
# simulator, so the two workers end within one chunk of each other, and a chunk stays far
# below pytest's 300 s timeout on a loaded machine.
COORD_CHUNK_SEEDS = 25
SHELL_CHUNK_SEEDS = 20
# Election seeds per test: 1,000 seeds in one test took 264 s beside the real-process
# tests and passed pytest's 300 s timeout when the machine was busier; a quarter each
# spreads them over both workers too.
ELECTION_CHUNK_SEEDS = 250
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
    return _replayed(request.config)


def _replayed(config: pytest.Config) -> int | None:
    single = config.getoption("sim_seed", default=None)
    if single is None and os.environ.get("SEED", "").strip():
        single = int(os.environ["SEED"])
    return None if single is None else int(single)


def _sim_seeds(config: pytest.Config) -> list[int]:
    """The election seeds: one replayed seed, or 0..N-1 (--sim-seeds)."""
    single = _replayed(config)
    if single is not None:
        return [single]
    return list(range(int(config.getoption("sim_seeds", default=DEFAULT_SEEDS))))


@pytest.fixture
def sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The seeds to run: one replayed seed, or 0..N-1."""
    return _sim_seeds(request.config)


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


def _seeds(config: pytest.Config, option: str, variable: str, default: int) -> list[int]:
    """One replayed seed, or 0..N-1 with N from the option, the variable or the default."""
    single = _replayed(config)
    if single is not None:
        return [single]
    count = config.getoption(option, default=None)
    if count is None:
        count = int(os.environ.get(variable, "").strip() or default)
    return list(range(int(count)))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The chunk parameters: ``election_chunk`` (election simulator), ``shell_chunk``
    (shipped-shell simulator) and ``coord_chunk`` (whole-node simulator), each a list of
    consecutive seeds."""
    from tests.sim.seed_runs import parametrize_chunks  # the simulators: only where used

    config = metafunc.config
    if "election_chunk" in metafunc.fixturenames:
        seeds = _sim_seeds(config)
        parametrize_chunks(metafunc, "election_chunk", seeds, ELECTION_CHUNK_SEEDS)
    if "shell_chunk" in metafunc.fixturenames:
        seeds = _seeds(config, "shell_seeds", "SHELL_SEEDS", SHELL_SEEDS_DEFAULT)
        parametrize_chunks(metafunc, "shell_chunk", seeds, SHELL_CHUNK_SEEDS)
    if "coord_chunk" in metafunc.fixturenames:
        seeds = _seeds(config, "coord_seeds", "COORD_SEEDS", COORD_SEEDS_DEFAULT)
        parametrize_chunks(metafunc, "coord_chunk", seeds, COORD_CHUNK_SEEDS)
