"""How a simulator's seeds run as tests (``tests/sim/seed_runs.py``): chunks of
consecutive seeds, and a failing chunk that still runs its other seeds and names each
failing one with its replay command."""

from __future__ import annotations

import pytest

from tests.sim.seed_runs import chunks, run_seeds
from tests.sim.shell_sim import ShellSimFailure, Stats


def _replay(seed: int) -> str:
    return f"SEED={seed} pytest tests/sim/test_x.py"


def test_seeds_are_cut_into_chunks_of_consecutive_seeds() -> None:
    assert chunks(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunks([42], 50) == [[42]]
    assert chunks([], 50) == []


def test_a_failing_chunk_runs_every_seed_and_names_each_failing_one() -> None:
    ran: list[int] = []

    def run_seed(seed: int) -> Stats:
        ran.append(seed)
        if seed == 2:
            raise ShellSimFailure(f"seed 2: acknowledged event lost\nreplay: {_replay(2)}")
        if seed == 4:
            raise KeyError("the harness broke")
        return Stats(acked=1)

    with pytest.raises(pytest.fail.Exception) as info:
        run_seeds("x sim", [1, 2, 3, 4, 5], run_seed, _replay)
    assert ran == [1, 2, 3, 4, 5]
    report = str(info.value)
    assert "x sim: 2 of 5 seeds failed: [2, 4]" in report
    assert "seed 2: acknowledged event lost" in report
    assert "seed 4: raised KeyError('the harness broke')" in report
    assert "Traceback" in report  # where the shipped code or the harness raised
    for seed in (2, 4):
        assert f"replay: {_replay(seed)}" in report


def test_a_chunk_whose_seeds_pass_passes() -> None:
    run_seeds("x sim", [1, 2], lambda seed: Stats(acked=seed), _replay)
