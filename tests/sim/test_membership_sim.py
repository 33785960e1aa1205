"""Membership changes under faults in the election simulator (tests/sim/membership_sim.py):
never two masters or two normal coordinators in one epoch, every normal group a majority of
its own node set, node sets moving one node at a time and never back, and convergence under
the newest set after healing.

Runs a twentieth of ``--sim-seeds`` (50 by default, ``make sim SEEDS=N`` scales it);
``--sim-seed=S`` replays one.
"""

from __future__ import annotations

import time

import pytest

from tests.sim.election_sim import SimFailure
from tests.sim.membership_sim import membership_reproduce_hint, run_membership_seed

pytestmark = pytest.mark.sim

# Membership seeds per election seed (each costs about as much as an election seed).
SEEDS_PER_SIM_SEED = 0.05


def test_membership_changes_under_faults(
    sim_seeds: list[int], request: pytest.FixtureRequest
) -> None:
    """Every seed keeps the invariants through its changes and converges after healing;
    over many seeds, changes are both made and refused."""
    seeds = sim_seeds
    if len(seeds) > 1:
        seeds = seeds[: max(1, round(len(seeds) * SEEDS_PER_SIM_SEED))]
    started = time.monotonic()
    done = refused = 0
    for seed in seeds:
        try:
            outcome = run_membership_seed(seed)
        except SimFailure as exc:
            pytest.fail(str(exc), pytrace=False)
        except Exception as exc:
            raise AssertionError(
                f"seed {seed} raised {exc!r}\n{membership_reproduce_hint(seed)}"
            ) from exc
        done += outcome.changes_done
        refused += outcome.changes_refused
    print(
        f"\nmembership sim: {len(seeds)} seeds in {time.monotonic() - started:.1f} s; "
        f"{done} changes made, {refused} refused"
    )
    if len(seeds) >= 50:
        assert done > 0 and refused > 0
