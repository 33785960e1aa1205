"""Faults per process in the chaos run (chaos/faults.py): the schedule draws kills,
pauses and partitions of a node's replica or coordinator alone, aims some at the master
(resolved when the fault starts), and overlaps two faults only within bounds that leave a
majority of nodes able to recover; the runner starts the second fault inside the first
and heals it first, and every process it stopped is started or resumed again."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest

from chaos import faults
from chaos.cluster import ChaosCluster
from chaos.history import HistoryWriter, read_history

NODES = ["n1", "n2", "n3", "n4", "n5"]
GATEWAYS = ["g1", "g2"]
ALL = [k for k in faults.KINDS if k != "clock_jump"]


def test_single_process_faults_are_scheduled_some_aimed_at_the_master() -> None:
    specs = [
        spec
        for seed in range(10)
        for spec in faults.schedule(seed, 600, NODES[:3], GATEWAYS, list(faults.PROCESS_FAULTS))
    ]
    assert {spec.kind for spec in specs} == set(faults.PROCESS_FAULTS)
    at_master = [spec for spec in specs if spec.role == "master"]
    fixed = [spec for spec in specs if not spec.role]
    assert at_master and fixed
    assert all(spec.targets == () for spec in at_master)
    assert all(len(spec.targets) == 1 and spec.targets[0] in NODES[:3] for spec in fixed)
    assert at_master[0].describe().split(" ")[1] == "<master>"
    assert "n2 (the master)" in at_master[0].describe(["n2"])


@pytest.mark.parametrize("nodes", [NODES[:3], NODES])
def test_overlaps_are_seeded_and_keep_a_majority_able_to_recover(nodes: list[str]) -> None:
    overlapped = []
    for seed in range(40):
        specs = faults.schedule(seed, 300, nodes, GATEWAYS, ALL)
        assert specs == faults.schedule(seed, 300, nodes, GATEWAYS, ALL)
        for spec in specs:
            assert faults.overlap_fits(spec, len(nodes)), spec.describe()
            second = spec.overlap
            if second is None:
                continue
            overlapped.append(spec)
            assert spec.kind in faults.OVERLAP_FIRST and spec.variant != "gateway"
            assert second.kind in faults.OVERLAP_SECOND and second.overlap is None
            # Healing a partition deletes every blackhole route: it is never the second.
            assert not second.kind.startswith("partition")
            assert second.role in ("master", "slave") and second.targets == ()
            # It starts inside the first fault's hold and ends (about) with it at the latest.
            assert 0 < second.gap_s < spec.hold_s
            assert second.gap_s + second.hold_s <= spec.hold_s + 0.5
            # Never more than a minority of nodes wholly out, never every node hit.
            assert spec.nodes_out + second.nodes_out <= (len(nodes) - 1) // 2
            assert spec.nodes_hit + second.nodes_hit < len(nodes)
    assert len(overlapped) > 10
    # Both combinations the issue names: a whole-node fault with a process fault, and
    # two process faults at once.
    assert any(
        s.kind in faults.WHOLE_NODE and s.overlap and s.overlap.kind in faults.PROCESS_FAULTS
        for s in overlapped
    )
    assert any(
        s.kind in faults.PROCESS_FAULTS and s.overlap and s.overlap.kind in faults.PROCESS_FAULTS
        for s in overlapped
    )


def test_no_overlap_when_its_probability_is_zero_or_no_kind_fits() -> None:
    for seed in range(10):
        assert all(
            s.overlap is None for s in faults.schedule(seed, 300, NODES[:3], GATEWAYS, ALL, 0.0)
        )
        # Three nodes, only whole-node kinds: a second node wholly out would be a majority.
        only_whole = faults.schedule(seed, 300, NODES[:3], GATEWAYS, ["kill", "pause"], 1.0)
        assert all(s.overlap is None for s in only_whole)
        # Only the kinds asked for are overlapped.
        mixed = faults.schedule(seed, 300, NODES[:3], GATEWAYS, ["pause", "kill_replica"], 1.0)
        pairs = [(s.kind, s.overlap.kind) for s in mixed if s.overlap is not None]
        assert pairs and {second for _, second in pairs} <= {"pause", "kill_replica"}
        # A paused node is wholly out: with three nodes, only a process fault may join it.
        assert all(second == "kill_replica" for first, second in pairs if first == "pause")


def test_an_overlap_out_of_bounds_is_refused() -> None:
    first = faults.FaultSpec("pause", ("n1",), 1.0, 3.0)
    second = faults.FaultSpec("kill", (), 0.5, 1.0, "node", role="slave")
    assert not faults.overlap_fits(replace(first, overlap=second), 3)
    assert faults.overlap_fits(replace(first, overlap=second), 5)
    process = faults.FaultSpec("pause_replica", (), 0.5, 1.0, role="slave")
    assert faults.overlap_fits(replace(first, overlap=process), 3)


@dataclass
class _FakeCluster:
    """Records what the runner does to processes (no process is started)."""

    node_ids: list[str]
    current_master: str | None = "n1"
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    paused: set[tuple[str, str]] = field(default_factory=set)

    def master(self) -> str | None:
        return self.current_master

    def kill_process(self, kind: str, node_id: str) -> None:
        self.calls.append(("kill", kind, node_id))

    def start_process(self, kind: str, node_id: str) -> None:
        self.calls.append(("start", kind, node_id))

    def pause_process(self, kind: str, node_id: str) -> None:
        self.paused.add((kind, node_id))
        self.calls.append(("pause", kind, node_id))

    def resume_process(self, kind: str, node_id: str) -> None:
        self.paused.discard((kind, node_id))
        self.calls.append(("resume", kind, node_id))

    def stop_process(self, kind: str, node_id: str) -> None:
        self.calls.append(("stop", kind, node_id))

    def stop_node(self, node_id: str) -> None:
        self.calls.append(("stop", "node", node_id))

    def start_node(self, node_id: str) -> None:
        self.calls.append(("start", "node", node_id))

    def pause_node(self, node_id: str) -> None:
        self.calls.append(("pause", "node", node_id))

    def resume_node(self, node_id: str) -> None:
        self.calls.append(("resume", "node", node_id))


def _runner(tmp_path: Path, cluster: _FakeCluster) -> faults.FaultRunner:
    history = HistoryWriter(tmp_path / "history.jsonl")
    return faults.FaultRunner(cast(ChaosCluster, cluster), history)


def test_roles_resolve_to_the_master_or_a_node_the_first_fault_spares(tmp_path: Path) -> None:
    runner = _runner(tmp_path, _FakeCluster(NODES[:3], current_master="n2"))
    at_master = faults.FaultSpec("kill_replica", (), 1.0, 1.0, role="master")
    assert runner.resolve(at_master) == ["n2"]
    # The master is the first fault's target: the overlap goes to another node.
    assert runner.resolve(at_master, exclude=("n2",)) in (["n1"], ["n3"])
    slave = faults.FaultSpec("pause", (), 1.0, 1.0, role="slave", pick=1)
    assert runner.resolve(slave) == ["n3"]  # slaves n1, n3; pick 1
    assert runner.resolve(slave, exclude=("n3",)) == ["n1"]
    assert runner.resolve(faults.FaultSpec("kill", ("n3",), 1.0, 1.0)) == ["n3"]


def test_an_overlap_starts_inside_the_first_fault_and_heals_before_it(tmp_path: Path) -> None:
    cluster = _FakeCluster(NODES[:3], current_master="n1")
    runner = _runner(tmp_path, cluster)
    second = faults.FaultSpec("pause_replica", (), 0.05, 0.1, role="slave", pick=0)
    first = faults.FaultSpec("kill_replica", (), 0.0, 0.3, role="master", overlap=second)
    outcome = faults.FaultOutcome(first)
    asyncio.run(runner.play(first, outcome))
    runner.history.close()
    assert cluster.calls == [
        ("kill", "replica", "n1"),
        ("pause", "replica", "n2"),
        ("resume", "replica", "n2"),
        ("start", "replica", "n1"),
    ]
    assert not outcome.problem and outcome.targets == ["n1"]
    assert "overlap: replica resumed" in outcome.detail and "replica restarted" in outcome.detail
    records: list[dict[str, Any]] = [
        dict(r) for r in read_history(tmp_path / "history.jsonl") if r["type"] == "fault"
    ]
    order = [(r["fault"], r["phase"], r["targets"]) for r in records]
    assert order == [
        ("kill_replica", "start", ["n1"]),
        ("pause_replica", "start", ["n2"]),
        ("pause_replica", "end", ["n2"]),
        ("kill_replica", "end", ["n1"]),
    ]
    assert "kill_replica n1 (the master)" in records[0]["detail"]
    json.dumps(records)


def test_an_orderly_stop_of_a_process_or_a_node_is_healed_by_restarting_it(
    tmp_path: Path,
) -> None:
    """stop_coordinator of the master overlapped by a slave node's stop: SIGTERM (the
    process drains and exits, as under systemd), then restarted, the overlap first."""
    cluster = _FakeCluster(NODES[:3], current_master="n2")
    runner = _runner(tmp_path, cluster)
    second = faults.FaultSpec("stop", (), 0.05, 0.1, role="slave", pick=0)
    first = faults.FaultSpec("stop_coordinator", (), 0.0, 0.3, role="master", overlap=second)
    assert faults.overlap_fits(first, 3)
    outcome = faults.FaultOutcome(first)
    asyncio.run(runner.play(first, outcome))
    runner.history.close()
    assert cluster.calls == [
        ("stop", "coordinator", "n2"),
        ("stop", "node", "n1"),
        ("start", "node", "n1"),
        ("start", "coordinator", "n2"),
    ]
    assert not outcome.problem and "coordinator restarted" in outcome.detail


def test_heal_all_resumes_and_restarts_single_processes(tmp_path: Path) -> None:
    class _Healing(_FakeCluster):
        topology = None
        down = {("replica", "n2")}

        def set_fault_control(self, node_id: str) -> None:
            pass

        def running(self, kind: str, name: str) -> bool:
            return (kind, name) not in self.down

    cluster = _Healing(NODES[:3])
    cluster.paused = {("coordinator", "n3")}
    _runner(tmp_path, cluster).heal_all()
    assert ("resume", "coordinator", "n3") in cluster.calls
    assert ("start", "replica", "n2") in cluster.calls
    assert not [c for c in cluster.calls if c[0] == "start" and c[2] != "n2"]


class _Topology:
    """Records the routes the runner asks for (no namespace is made)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def partition_process(self, node_id: str, process: str) -> None:
        self.calls.append(("partition_process", node_id, process))

    def heal(self) -> None:
        self.calls.append(("heal",))


@pytest.mark.parametrize("process", ["replica", "coordinator"])
def test_a_process_partition_cuts_that_process_of_its_target_alone_then_heals(
    tmp_path: Path, process: str
) -> None:
    topology = _Topology()
    cluster = _FakeCluster(NODES[:3], current_master="n2")
    cluster.topology = topology  # type: ignore[attr-defined]
    runner = _runner(tmp_path, cluster)
    spec = faults.FaultSpec(f"partition_{process}", (), 0.0, 0.05, role="master")
    outcome = faults.FaultOutcome(spec)
    asyncio.run(runner.play(spec, outcome))
    runner.history.close()
    assert topology.calls == [("partition_process", "n2", process), ("heal",)]
    assert cluster.calls == []  # no process was killed, paused or started
    assert not outcome.problem and outcome.detail == f"{process} links healed"


def test_a_process_partition_without_namespaces_is_a_problem_not_a_silent_pass(
    tmp_path: Path,
) -> None:
    cluster = _FakeCluster(NODES[:3])
    cluster.topology = None  # type: ignore[attr-defined]
    cluster.set_fault_control = lambda node_id: None  # type: ignore[attr-defined]
    cluster.running = lambda kind, name: True  # type: ignore[attr-defined]
    runner = _runner(tmp_path, cluster)
    spec = faults.FaultSpec("partition_replica", ("n3",), 0.0, 0.05)
    outcome = faults.FaultOutcome(spec)
    asyncio.run(runner.play(spec, outcome))
    runner.history.close()
    assert "partition_replica needs network namespaces" in outcome.problem
