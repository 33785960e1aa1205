"""The membership change rules (services/coordinator/membership.py): each unsafe or malformed
change is refused with a sentence naming the problem, and a safe one changes one node."""

from __future__ import annotations

from pathlib import Path

import pytest

from squall_server.coordinator.membership import (
    ChangeKind,
    ChangeRefused,
    Member,
    Membership,
    MembershipChange,
    apply_change,
    newest,
)

THREE = Membership.bootstrap(
    [Member(x, p, f"h{x}:1", f"h{x}:2") for x, p in (("1", 3), ("2", 2), ("3", 1))]
)


def change(
    kind: ChangeKind, node: str, priority: int = 1, coord: str = "", rep: str = ""
) -> MembershipChange:
    return MembershipChange(kind, node, priority, coord or f"h{node}x:1", rep or f"h{node}x:2")


@pytest.mark.parametrize(
    ("the_change", "live", "phrase"),
    [
        (change(ChangeKind.ADD, "2"), ("1", "2", "3"), "node id 2 is already a member"),
        (change(ChangeKind.ADD, "4", coord="h3:2"), ("1", "2", "3"), "already node 3's replica"),
        (change(ChangeKind.ADD, "4", coord="x", rep="h4:2"), ("1", "2", "3"), "is not host:port"),
        (change(ChangeKind.ADD, "4", priority=-1), ("1", "2", "3"), "is negative"),
        (change(ChangeKind.ADD, "bad id"), ("1", "2", "3"), "is not 1 to 64 characters"),
        (change(ChangeKind.PROMOTE, "2"), ("1", "2", "3"), "already votes"),
        (change(ChangeKind.REMOVE, "2"), ("1", "2"), "unable to form a majority"),
        (change(ChangeKind.REMOVE, "1"), ("1", "2", "3"), "coordinates the serving group"),
        (change(ChangeKind.REMOVE, "9"), ("1", "2", "3"), "node 9 is not a member"),
        (change(ChangeKind.REPLACE, "3"), ("1", "2", "3"), "is a live member"),
        (change(ChangeKind.REPLACE, "3", coord="h2:1"), ("1", "2"), "already node 2's"),
        (change(ChangeKind.SET_PRIORITY, "2", priority=2), ("1", "2", "3"), "already has"),
    ],
)
def test_unsafe_or_malformed_changes_are_refused(
    the_change: MembershipChange, live: tuple[str, ...], phrase: str
) -> None:
    with pytest.raises(ChangeRefused, match=phrase):
        apply_change(THREE, the_change, live=live, coordinator="1")


def test_every_change_moves_one_node_and_one_version() -> None:
    grown = apply_change(THREE, change(ChangeKind.ADD, "4"), live=("1", "2", "3"), coordinator="1")
    assert grown.ids == ("1", "2", "3", "4") and grown.version == 1
    shrunk = apply_change(
        grown, change(ChangeKind.REMOVE, "4"), live=("1", "2", "3"), coordinator="1"
    )
    assert shrunk.ids == ("1", "2", "3") and shrunk.version == 2
    moved = apply_change(THREE, change(ChangeKind.REPLACE, "3"), live=("1", "2"), coordinator="1")
    member = moved.member("3")
    assert member is not None and member.coordinator_address == "h3x:1" and member.priority == 1
    assert member.learner and moved.voters == ("1", "2")
    raised = apply_change(
        THREE, change(ChangeKind.SET_PRIORITY, "3", priority=9), live=("1", "2"), coordinator="1"
    )
    assert raised.priorities == {"1": 3, "2": 2, "3": 9}


def test_the_set_of_the_newest_group_wins() -> None:
    old = Membership(3, 5, THREE.members)
    carried_later = Membership(2, 9, THREE.members)
    assert newest({"a": old, "b": carried_later}) == "b"
    assert newest({}) == ""


def test_bootstrap_set_has_the_config_files_node_entries() -> None:
    assert THREE.settings()[0] == ("nodes.1", "priority=3 coordinator=h1:1 replica=h1:2")


def test_config_export_writes_a_file_the_services_load(tmp_path: Path) -> None:
    """`squall cluster config export`: the running set replaces [[nodes]], its version and
    epoch go in [cluster], the rest of the file is kept; a bad version is refused."""
    from squall.v1 import coordinator_pb2
    from squall_server.cli.membership import export_text
    from squall_server.common.config import ConfigError, load_config

    source = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
    config = load_config(source)
    running = coordinator_pb2.NodeSet(
        version=2,
        epoch=9,
        members=[
            coordinator_pb2.MemberSpec(
                node_id=n.id,
                priority=n.priority,
                coordinator_address=n.coordinator_address,
                replica_address=n.replica_address,
            )
            for n in config.nodes
        ]
        + [
            coordinator_pb2.MemberSpec(
                node_id="n4",
                priority=1,
                coordinator_address="127.0.0.1:7999",
                replica_address="127.0.0.1:7998",
                learner=True,
            )
        ],
    )
    exported = tmp_path / "exported.toml"
    exported.write_text(export_text(config, running, {"n4": str(tmp_path / "n4")}))
    again = load_config(exported)
    assert [n.id for n in again.nodes] == [*(n.id for n in config.nodes), "n4"]
    assert (again.membership_version, again.membership_epoch) == (2, 9)
    assert again.node("n4").data_dir == tmp_path / "n4"
    assert again.node("n4").learner and not again.node(config.nodes[0].id).learner
    assert again.agreed_settings()[1:] != config.agreed_settings()[1:]
    assert again.durability == config.durability and again.timeouts == config.timeouts
    exported.write_text(
        exported.read_text().replace("membership_version = 2", "membership_version = -1")
    )
    with pytest.raises(ConfigError, match=r"cluster\.membership_version"):
        load_config(exported)


def test_a_new_node_learns_before_it_votes() -> None:
    """add-node and replace-node bring a learner: the voters, and so every majority, stay
    as they were until the coordinator promotes it (one voter more); a learner counts for
    no quorum check, and an empty-handed promotion is refused."""
    live = ("1", "2")  # node 3 is down: adding a learner is still safe
    grown = apply_change(THREE, change(ChangeKind.ADD, "4"), live=live, coordinator="1")
    assert grown.voters == ("1", "2", "3") and grown.learners == ("4",)
    assert grown.majority == 2 and grown.describe().endswith("3:1,4:1L")
    with pytest.raises(ChangeRefused, match="not in the serving group"):
        apply_change(grown, change(ChangeKind.PROMOTE, "4"), live=live, coordinator="1")
    promoted = apply_change(
        grown, change(ChangeKind.PROMOTE, "4"), live=("1", "2", "3", "4"), coordinator="1"
    )
    assert promoted.voters == ("1", "2", "3", "4") and promoted.learners == ()
    # 2 of 4 voters would not be a majority of the new set: refused.
    with pytest.raises(ChangeRefused, match="unable to form a majority"):
        apply_change(grown, change(ChangeKind.PROMOTE, "4"), live=("1", "4"), coordinator="1")
    # A learner's absence never blocks removing a voter that keeps the majority.
    shrunk = apply_change(grown, change(ChangeKind.REMOVE, "3"), live=live, coordinator="1")
    assert shrunk.voters == ("1", "2") and shrunk.learners == ("4",)
    assert ("nodes.4", "priority=1 coordinator=h4x:1 replica=h4x:2 learner") in grown.settings()
