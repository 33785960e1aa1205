"""`squall status` notes and `--explain`, and `squall cluster` bad input, against a fake
gateway or no cluster at all.

Goal: an operator sees who set each control, when and why; `--explain` says why the master
leads and who would lead if each node failed; a bad `squall cluster` command exits with a
message naming the problem before anything is sent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from squall.v1 import common_pb2
from tests.unit.test_cli import broker, fakes, run  # noqa: F401  (broker is a fixture)

_AT_MS = 1_763_780_741_000  # 2025-11-22T03:05:41Z


def _three_nodes(status: Any) -> None:
    """n1 leads n1,n3 in epoch 7; n2 is quarantined; n3 runs an override set by carol."""
    common = {"reachable": True, "max_seen": 3, "epoch": 7, "last_epoch": 7}
    status.nodes.add(
        node_id="n1",
        coordinator_id="n1",
        group_name="n1:abc",
        state=common_pb2.NODE_STATE_NORMAL,
        group=["n3"],
        role=common_pb2.ROLE_MASTER,
        priority=3,
        last_lsn=40,
        quorum_required=2,
        invited=["n2", "n3"],
        sync_source_id="n1",
        **common,
    )
    status.nodes.add(
        node_id="n2",
        coordinator_id="n2",
        group_name="n2:def",
        state=common_pb2.NODE_STATE_INACTIVE,
        role=common_pb2.ROLE_INACTIVE,
        priority=2,
        last_lsn=38,
        quorum_required=2,
        quarantine=common_pb2.OperatorRecord(
            at_ms=_AT_MS, operator="replica", action="quarantine", reason="replica fault: crc"
        ),
        audit=[
            common_pb2.OperatorRecord(
                at_ms=_AT_MS, operator="replica", action="quarantine", reason="replica fault: crc"
            )
        ],
        fault_reason="checksum error serving a read",
        **common,
    )
    status.nodes.add(
        node_id="n3",
        coordinator_id="n1",
        group_name="n1:abc",
        state=common_pb2.NODE_STATE_NORMAL,
        role=common_pb2.ROLE_SLAVE,
        priority=1,
        last_lsn=40,
        quorum_required=1,
        quorum_override=1,
        quorum_override_record=common_pb2.OperatorRecord(
            at_ms=_AT_MS, operator="carol", action="quorum-override 1", reason="site A lost"
        ),
        **common,
    )
    status.master_id = "n1"
    status.epoch = 7


def test_status_notes_say_who_when_and_why(
    broker: Any,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker.status.Clear()
    _three_nodes(broker.status)
    code, out, _ = run(["status"], capsys)
    assert code == 0
    assert "QUARANTINED" in out.splitlines()[2]  # n2's state cell
    assert (
        "n3: QUORUM OVERRIDE 1 set by carol at 2025-11-22T03:05:41Z: site A lost "
        "(clears itself once a majority is back)"
    ) in out
    assert "n2: QUARANTINED by replica at 2025-11-22T03:05:41Z: replica fault: crc;" in out
    assert "squall cluster unquarantine n2" in out


def test_status_explain(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    broker.status.Clear()
    _three_nodes(broker.status)
    code, out, _ = run(["status", "--explain"], capsys)
    assert code == 0
    assert "n1 leads group n1:abc in epoch 7 with n1,n3 (2 of 3 nodes)." in out
    assert "When the group formed, n1 invited n2,n3." in out
    assert "n2 2025-11-22T03:05:41Z replica: quarantine: replica fault: crc" in out
    lines = out.splitlines()
    member = next(line for line in lines if line.startswith("  n2  2"))
    assert "QUARANTINED" in member and "7/38" in member
    # n2 is out already: if n1 fails, n3 alone leads only because of its own override.
    n1_fails = next(line for line in lines if line.strip().startswith("n1 fails ->"))
    assert "n3 would lead" in n1_fails and "operator quorum override" in n1_fails
    n3_fails = next(line for line in lines if line.strip().startswith("n3 fails ->"))
    assert "no master" in n3_fails and "1 of 3 nodes left, 2 required" in n3_fails
    code, out, _ = run(["status", "--json", "--explain"], capsys)
    data = json.loads(out)
    verdicts = {v["failed"]: v["leader"] for v in data["explain"]["if_failed"]}
    assert verdicts == {"n1": "n3", "n2": "n1", "n3": ""}
    assert data["nodes"][1]["quarantine"]["operator"] == "replica"


def _config(tmp_path: Path) -> str:
    text = "".join(
        f'[[nodes]]\nid = "n{i}"\npriority = {4 - i}\n'
        f'coordinator_address = "{address}"\nreplica_address = "127.0.0.1:{20 + i}"\n'
        f'data_dir = "data/n{i}"\n\n'
        for i, address in ((1, "127.0.0.1:1"), (2, "127.0.0.1:2"), (3, "127.0.0.1:3"))
    )
    path = tmp_path / "cluster.toml"
    gateway = '[[gateways]]\nid = "g"\naddress = "127.0.0.1:4"\n'
    path.write_text('[cluster]\nname = "t"\n\n' + text + gateway)
    return str(path)


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["cluster", "transfer", "--to", "n9"], "n9"),
        (["cluster", "transfer", "--to", "n2", "--wait-ms", "0"], "--wait-ms must be 1..60000"),
        (["cluster", "quarantine", "n7"], "n7"),
        (["cluster", "transfer", "--to", "n2", "--timeout", "0.5"], "no master to transfer from"),
    ],
)
def test_cluster_bad_input_is_one_line_and_sends_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], phrase: str
) -> None:
    code, out, err = run([*argv, "--config", _config(tmp_path)], capsys)
    assert code == 1 and out == ""
    assert err.startswith("squall: ") and phrase in err and err.count("\n") == 1, err


def test_status_names_a_replica_that_does_not_answer(
    broker: Any,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One fate per node: n2's coordinator answers, its replica does not."""
    broker.status.Clear()
    _three_nodes(broker.status)
    n2 = broker.status.nodes[1]
    n2.ClearField("quarantine")
    n2.reachable = False
    n2.error = "replica: UNAVAILABLE: connection refused"
    n2.last_change_reason = "replica unreachable: no answer for 302 ms"
    n2.replica_unreachable_since_ms = _AT_MS
    code, out, _ = run(["status"], capsys)
    assert code == 0
    row = out.splitlines()[2]
    assert row.startswith("n2 ") and "REPLICA UNREACHABLE" in row, row
    assert "replica unreachable since 2025-11-22T03:05:41Z" in row, row
    assert "replica: UNAVAILABLE: connection refused" in row, row
    assert "n2: replica unreachable since 2025-11-22T03:05:41Z; its coordinator keeps" in out
    code, out, _ = run(["status", "--explain"], capsys)
    member = next(line for line in out.splitlines() if line.startswith("  n2  2"))
    assert "REPLICA UNREACHABLE" in member, member


def test_status_explains_a_node_that_steps_aside_after_master_refusals(
    broker: Any,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """n1 ranks highest but its replica kept refusing the master role: n2 leads meanwhile."""
    broker.status.Clear()
    _three_nodes(broker.status)
    n1, n2, n3 = broker.status.nodes
    n1.state, n1.role, n1.group_name = (
        common_pb2.NODE_STATE_INACTIVE,
        common_pb2.ROLE_INACTIVE,
        "n1:x",
    )
    del n1.group[:]
    n1.lead_held_off_until_ms = _AT_MS
    n1.lead_held_off_reason = (
        "its replica refused the master role 3 times in a row (last: storing the log "
        "fetched from n2 failed: StoreError: disk full)"
    )
    n2.ClearField("quarantine")
    n2.fault_reason = ""
    n2.state, n2.role, n2.group_name = common_pb2.NODE_STATE_NORMAL, common_pb2.ROLE_MASTER, "n2:y"
    n2.coordinator_id = "n2"
    n2.group.append("n3")
    n3.coordinator_id, n3.group_name = "n2", "n2:y"
    broker.status.master_id = "n2"
    code, out, _ = run(["status"], capsys)
    assert code == 0
    assert "STEPPED ASIDE" in out.splitlines()[1] + out.splitlines()[2], out
    assert "n1: steps aside until 2025-11-22T03:05:41Z" in out
    assert "refused the master role 3 times in a row" in out and "disk full" in out, out
    code, out, _ = run(["status", "--explain"], capsys)
    assert "n1 ranks higher but is not in the group (steps aside until" in out, out
    # Out of every group, it is no candidate should the master fail.
    assert "n2 fails -> n3 would lead" in out and "(n1 already out)" in out, out


def test_status_names_a_frozen_replica_and_when_its_freeze_lapses(
    broker: Any,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A shutdown was interrupted and could not thaw n1: the master refuses writes, and
    the status says why and for how long, where before it showed a healthy master."""
    broker.status.Clear()
    _three_nodes(broker.status)
    n1 = broker.status.nodes[0]
    n1.frozen_for_shutdown_id = "3e957bbf"
    n1.freeze_remaining_ms = 41_600
    code, out, _ = run(["status"], capsys)
    assert code == 0
    assert (
        "n1: FROZEN for cluster shutdown 3e957bbf: takes no new role, and as master no new "
        "write; lapses by itself in 42 s unless the shutdown finishes or aborts first"
    ) in out, out
    assert "FROZEN" not in "\n".join(line for line in out.splitlines() if line.startswith("n2"))
