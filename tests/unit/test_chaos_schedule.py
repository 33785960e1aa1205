"""The chaos run's fault schedule (chaos/faults.py): a pure function of its seed, one
fault at a time, ending before the run does, over the kinds asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from chaos import faults
from chaos.run import RunResult, enabled_kinds, run_chaos

NODES = ["n1", "n2", "n3", "n4", "n5"]
GATEWAYS = ["g1", "g2"]
KINDS = ["kill", "pause", "partition", "map_full", "corrupt", "slow_disk"]


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = faults.schedule(7, 600, NODES, GATEWAYS, KINDS)
    assert first == faults.schedule(7, 600, NODES, GATEWAYS, KINDS)
    assert first != faults.schedule(8, 600, NODES, GATEWAYS, KINDS)
    assert {spec.kind for spec in first} == set(KINDS)


@pytest.mark.parametrize("seed", range(20))
def test_every_fault_hits_a_minority_and_ends_before_the_run(seed: int) -> None:
    for nodes in (NODES[:3], NODES):
        specs = faults.schedule(seed, 120, nodes, GATEWAYS, KINDS)
        elapsed = faults.WARMUP_S
        for spec in specs:
            elapsed += spec.gap_s + spec.hold_s
            if spec.variant == "gateway":
                assert len(spec.targets) == 1 and spec.targets[0] in GATEWAYS
            else:
                assert set(spec.targets) <= set(nodes)
                assert 2 * len(spec.targets) < len(nodes)
        assert elapsed <= 120 - faults.TAIL_S


def test_only_the_kinds_asked_for_are_scheduled() -> None:
    specs = faults.schedule(3, 300, NODES[:3], GATEWAYS, ["pause", "clock_jump"])
    assert specs and {spec.kind for spec in specs} == {"pause"}
    assert faults.schedule(3, 300, NODES[:3], GATEWAYS, ["clock_jump"]) == []


def test_clock_jump_is_not_applicable_and_partitions_need_namespaces() -> None:
    kinds, skipped = enabled_kinds(None, netns_ok=False, why="not root")
    assert "clock_jump" not in kinds and "partition" not in kinds
    assert skipped["clock_jump"].startswith("not applicable: no timeout depends on wall time")
    for kind in ("partition", "partition_replica", "partition_coordinator"):
        assert skipped[kind] == "left out: not root"
    assert "kill_replica" in kinds
    kinds, skipped = enabled_kinds(None, netns_ok=True, why="")
    assert "partition" in kinds and list(skipped) == ["clock_jump"]
    with pytest.raises(ValueError, match="unknown fault kind"):
        enabled_kinds(["earthquake"], netns_ok=True, why="")


def test_a_run_takes_an_ack_policy_under_which_no_acknowledged_event_may_be_lost(
    tmp_path: Path,
) -> None:
    """`--acks group` runs the cluster under acks "group" and its reproduce line says so;
    `none`, under which a master's crash may lose acknowledged events, is refused."""
    result = RunResult(3, 30.0, 3, tmp_path / "h.jsonl", acks="group")
    assert result.reproduce().endswith("NODES=3 ACKS=group")
    assert "ACKS" not in RunResult(3, 30.0, 3, tmp_path / "h.jsonl").reproduce()
    with pytest.raises(ValueError, match="acks must be one of majority, group"):
        asyncio.run(run_chaos(3, 30.0, 3, tmp_path / "run", acks="none"))
