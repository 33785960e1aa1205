"""Consistency at start with real processes: a node restarted from a file whose acks policy
differs is refused by the others, named with both values in their logs, in `squall status`
and its `--json`; the other two keep serving; once its file is fixed and it restarts, it
joins (docs/operations.md, "Consistency at start")."""

from __future__ import annotations

import json

import pytest

from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.integration.conftest import LocalCluster, run_squall, wait_for

pytestmark = pytest.mark.integration


def _refusals(cluster: LocalCluster) -> dict[str, set[tuple[str, str, str, str]]]:
    return {
        node: {(m.node_id, m.key, m.local_value, m.peer_value) for m in status.config_mismatches}
        for node, status in cluster.statuses().items()
    }


def test_node_with_differing_acks_is_refused_then_joins_once_fixed(
    cluster_factory: object,
) -> None:
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    assert cluster.wait_for_master() == "n1"
    cluster.kill_node("n3")

    text = cluster.config_path.read_text()
    assert 'acks = "majority"' in text
    differing = cluster.run_dir / "n3-differs.toml"
    differing.write_text(text.replace('acks = "majority"', 'acks = "all"', 1))
    cluster.start_node("n3", differing)

    wanted = {
        "n1": {("n3", "durability.acks", "majority", "all")},
        "n2": {("n3", "durability.acks", "majority", "all")},
        "n3": {
            ("n1", "durability.acks", "all", "majority"),
            ("n2", "durability.acks", "all", "majority"),
        },
    }
    wait_for(lambda: _refusals(cluster) == wanted, 30, f"refusals {wanted}")
    statuses = cluster.statuses()
    assert statuses["n3"].state != common_pb2.NODE_STATE_NORMAL
    assert "n3" not in statuses["n1"].group
    assert "durability.acks: this node 'majority', n3 'all'" in cluster.log("coordinator", "n1")
    assert "durability.acks: this node 'all', n1 'majority'" in cluster.log("coordinator", "n3")

    # The other two serve: a write commits with n1 master and n2 its slave.
    with cluster.channel() as channel:
        broker_pb2_grpc.TopicManagerStub(channel).CreateTopic(
            broker_pb2.CreateTopicRequest(name="while-n3-refused"), timeout=20
        )

    table = run_squall("status", "--gateway", cluster.gateway_address)
    assert table.returncode == 0, table.stderr
    assert (
        "n1: REFUSES n3: configuration differs: durability.acks is 'majority' here, 'all' on n3"
        in table.stdout
    ), table.stdout
    as_json = run_squall("status", "--gateway", cluster.gateway_address, "--json")
    assert as_json.returncode == 0, as_json.stderr
    rows = {n["node_id"]: n for n in json.loads(as_json.stdout)["nodes"]}
    assert rows["n2"]["config_mismatches"] == [
        {"node_id": "n3", "key": "durability.acks", "local_value": "majority", "peer_value": "all"}
    ]

    # Fixed: restarted from the cluster's file, n3 is merged back and nobody refuses it.
    cluster.kill_node("n3")
    cluster.start_node("n3")
    wait_for(
        lambda: (
            cluster.statuses().get("n3", None) is not None
            and cluster.statuses()["n3"].state == common_pb2.NODE_STATE_NORMAL
            and cluster.replica_role("n3") == common_pb2.ROLE_SLAVE
        ),
        30,
        "n3 back in the group as a slave",
    )
    assert _refusals(cluster) == {"n1": set(), "n2": set(), "n3": set()}
    assert "now shares this node's agreed settings" in cluster.log("coordinator", "n1")
