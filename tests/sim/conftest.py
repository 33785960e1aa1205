"""Options for the election simulator: how many seeds, or one seed to replay.

``--sim-seeds=N`` runs seeds 0..N-1 (default 1000; ``make sim SEEDS=N``). ``--sim-seed=S``
(or the ``SEED`` environment variable, which ``make sim SEED=S`` exports) replays one seed.
"""

from __future__ import annotations

import os

import pytest

DEFAULT_SEEDS = 1000


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


@pytest.fixture
def sim_seeds(request: pytest.FixtureRequest) -> list[int]:
    """The seeds to run: one replayed seed, or 0..N-1."""
    single = request.config.getoption("sim_seed", default=None)
    if single is None and os.environ.get("SEED", "").strip():
        single = int(os.environ["SEED"])
    if single is not None:
        return [int(single)]
    count = request.config.getoption("sim_seeds", default=DEFAULT_SEEDS)
    return list(range(int(count)))
