"""Seeded simulation of three shipped ReplicaNodes (the whole async shell) under faults.

``tests/sim/shell_sim.py`` runs each seed on a virtual-time event loop: crashes, pauses,
cuts, resets, slow and failing disks, then healing and the checks (one master per epoch,
a publish acknowledged soon after healing, identical logs, every acknowledged event
readable on every replica). ``make test`` runs ``SHELL_SEEDS_DEFAULT`` seeds; a long run
is ``--shell-seeds=N`` (or ``SHELL_SEEDS=N``); ``SEED=S`` replays one seed. A planted
bug (acknowledging before any replica holds the write) must be caught.
"""

from __future__ import annotations

import pytest

from squall.v1 import common_pb2
from tests.sim.seed_runs import run_seeds
from tests.sim.shell_sim import ShellSimFailure, replay_command, run_seed

pytestmark = pytest.mark.sim

# The seeds run as this many tests (every CHUNKS-th seed each): a failure names its part.
CHUNKS = 8
# The planted bug must be caught within this many seeds (caught in the second today).
MUTANT_SEEDS_MAX = 10


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_shipped_replicas_keep_acknowledged_events_and_recover(
    shell_seeds: list[int], chunk: int
) -> None:
    """Every seed: no acknowledged event lost, identical logs, one master per epoch, and
    a publish acknowledged within the liveness bound after healing."""
    run_seeds("shell sim", shell_seeds[chunk::CHUNKS], run_seed, replay_command)


def test_planted_early_acknowledgement_is_caught() -> None:
    """With ACK_POLICY_NONE a master acknowledges what no replica holds: some seed must
    lose an acknowledged event, or the checks prove nothing."""
    for seed in range(MUTANT_SEEDS_MAX):
        try:
            run_seed(seed, acks=common_pb2.ACK_POLICY_NONE)
        except ShellSimFailure as exc:
            assert "acknowledged event" in str(exc)
            assert replay_command(seed) in str(exc)
            return
    pytest.fail(f"no seed of {MUTANT_SEEDS_MAX} caught an acknowledgement without replicas")
