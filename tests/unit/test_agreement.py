"""Consistency at start: which settings members must share, their digest, how a
difference is named, and how the election refuses a node whose settings differ."""

from __future__ import annotations

from pathlib import Path

from squall_server.common.config import ClusterConfig, parse_config
from squall_server.coordinator.agreement import differences, settings_digest
from squall_server.coordinator.election import Election, ElectionConfig
from squall_server.coordinator.messages import (
    AreYouCoordinator,
    AreYouCoordinatorReply,
    Invitation,
    LogLevel,
    PeerMessage,
    PersistedState,
    RejectCode,
    ReplicaReport,
    StoreState,
)
from tests.unit.test_config import VALID, replaced


def parse(text: str) -> ClusterConfig:
    return parse_config(text, Path("/etc/squall/squall.toml"))


def digest_of(text: str) -> str:
    return settings_digest(parse(text).agreed_settings())


def test_agreed_settings_name_the_options_that_must_agree() -> None:
    settings = dict(parse(VALID).agreed_settings())
    assert settings["cluster.name"] == "test"
    assert settings["nodes.n1"] == ("priority=3 coordinator=127.0.0.1:7101 replica=127.0.0.1:7201")
    assert settings["durability.acks"] == "majority"
    assert settings["durability.master_sync"] == "SYNC"
    assert settings["durability.replica_sync"] == "WRITE_NO_SYNC"
    assert settings["limits.max_event_bytes"] == str(1024 * 1024)
    assert settings["limits.dedupe_window"] == "100000"


def test_digest_changes_with_each_agreed_option() -> None:
    base = digest_of(VALID)
    changed = [
        replaced('name = "test"', 'name = "other"'),
        VALID + '\n[durability]\nacks = "all"\n',
        VALID + '\n[durability]\nmaster_sync = "NO_SYNC"\n',
        VALID + '\n[durability]\nreplica_sync = "SYNC"\n',
        VALID + "\n[limits]\nmax_event_bytes = 2048\n",
        VALID + "\n[limits]\ndedupe_window = 200000\n",
        replaced("priority = 3", "priority = 4"),
        replaced('replica_address = "127.0.0.1:7201"', 'replica_address = "127.0.0.1:7301"'),
    ]
    digests = [digest_of(text) for text in changed]
    assert base not in digests
    assert len(set(digests)) == len(digests)


def test_digest_ignores_local_options() -> None:
    """Each host's paths and tuning may differ; node order in the file does not matter."""
    base = digest_of(VALID)
    assert digest_of(replaced('data_dir = "data/n1"', 'data_dir = "/srv/n1"')) == base
    assert digest_of(VALID + "\n[timeouts]\nheartbeat_interval_ms = 150\n") == base
    assert digest_of(VALID + "\n[limits]\nmap_size_bytes = 2147483648\n") == base
    assert digest_of(VALID + '\n[logging]\nlevel = "DEBUG"\n') == base
    first, _, rest = VALID.partition('[[nodes]]\nid = "n2"')
    head, _, n1 = first.partition('[[nodes]]\nid = "n1"')
    reordered = head + '[[nodes]]\nid = "n2"' + rest.split("[[gateways]]")[0]
    reordered += '[[nodes]]\nid = "n1"' + n1 + "[[gateways]]" + rest.split("[[gateways]]")[1]
    assert parse(reordered).nodes[0].id == "n2"
    assert digest_of(reordered) == base


def test_differences_name_each_setting_and_both_values() -> None:
    mine = (("durability.acks", "majority"), ("cluster.name", "prod"))
    theirs = (("durability.acks", "all"), ("cluster.name", "prod"), ("limits.x", "1"))
    diffs = differences(mine, theirs)
    assert [d.describe("n3") for d in diffs] == [
        "durability.acks: this node 'majority', n3 'all'",
        "limits.x: this node (not set), n3 '1'",
    ]
    # Without the peer's values, the two digests are what can be named.
    (only,) = differences(mine, (), their_digest="abc")
    assert only.describe("n3") == f"settings digest: this node '{settings_digest(mine)}', n3 'abc'"
    assert settings_digest(()) == ""


MINE = (("cluster.name", "prod"), ("durability.acks", "majority"))
THEIRS = (("cluster.name", "prod"), ("durability.acks", "all"))


def node(settings: tuple[tuple[str, str], ...] = MINE) -> Election:
    counter = iter(range(1, 1000))
    election = Election(
        ElectionConfig(node_id="1", priorities={"1": 1, "2": 2, "3": 3}, agreed_settings=settings),
        PersistedState(),
        lambda: f"g{next(counter)}",
    )
    election.tick(0)
    election.replica_report(ReplicaReport("", 0, 0, StoreState.EMPTY, command_seq=1), 0)
    return election


def test_a_node_whose_settings_differ_is_refused_and_named_in_status() -> None:
    election = node()
    theirs = settings_digest(THEIRS)
    ready = election.step(
        PeerMessage("3", "1", AreYouCoordinator("3:a", 3, settings_digest=theirs)), 10
    )
    # The answer carries this node's values so the prober can name the difference.
    (reply,) = [m.body for m in ready.messages if isinstance(m.body, AreYouCoordinatorReply)]
    assert reply.settings == MINE and reply.settings_digest == settings_digest(MINE)
    ready = election.step(
        PeerMessage(
            "3",
            "1",
            AreYouCoordinatorReply(True, "3:a", 3, settings_digest=theirs, settings=THEIRS),
        ),
        20,
    )
    errors = [e for e in ready.events if e.level is LogLevel.ERROR]
    assert [e.event for e in errors] == ["config-mismatch"]
    assert "durability.acks: this node 'majority', 3 'all'" in errors[0].message
    (row,) = election.status().config_mismatches
    assert (row.node_id, row.key, row.local_value, row.peer_value) == (
        "3",
        "durability.acks",
        "majority",
        "all",
    )
    # Its invitation is refused, naming the setting, and changes nothing.
    before = election.status().group_name
    ready = election.step(
        PeerMessage("3", "1", Invitation("3:b", 3, 0, settings_digest=theirs)), 30
    )
    assert ready.rejection is not None
    assert ready.rejection.code is RejectCode.FAILED_PRECONDITION
    assert "durability.acks: this node 'majority', 3 'all'" in ready.rejection.message
    assert election.status().group_name == before
    # Once it reports the same settings it is no longer refused.
    election.step(
        PeerMessage("3", "1", AreYouCoordinator("3:c", 3, settings_digest=settings_digest(MINE))),
        40,
    )
    assert election.status().config_mismatches == ()


def test_an_invitation_with_the_same_settings_is_accepted() -> None:
    election = node()
    ready = election.step(
        PeerMessage("3", "1", Invitation("3:b", 3, 0, settings_digest=settings_digest(MINE))),
        30,
    )
    assert ready.rejection is None
    assert election.status().coordinator_id == "3"


def test_a_node_whose_file_gives_it_another_priority_is_named_not_just_rejected() -> None:
    """A priority that differs is a setting that differs: the node is refused and named,
    rather than its messages only bounced as a priority mismatch."""
    election = node()
    theirs = (("cluster.name", "prod"), ("durability.acks", "majority"), ("nodes.3", "p=9"))
    digest = settings_digest(theirs)
    ready = election.step(
        PeerMessage(
            "3",
            "1",
            AreYouCoordinatorReply(True, "3:a", 9, settings_digest=digest, settings=theirs),
        ),
        10,
    )
    assert ready.rejection is None
    (row,) = election.status().config_mismatches
    assert (row.node_id, row.key, row.local_value, row.peer_value) == ("3", "nodes.3", "", "p=9")
    ready = election.step(
        PeerMessage("3", "1", AreYouCoordinator("3:b", 9, settings_digest=digest)), 20
    )
    assert ready.rejection is None
    (reply,) = [m.body for m in ready.messages if isinstance(m.body, AreYouCoordinatorReply)]
    assert reply.settings == MINE
    ready = election.step(
        PeerMessage("3", "1", Invitation("3:c", 9, 0, settings_digest=digest)), 30
    )
    assert ready.rejection is not None
    assert ready.rejection.code is RejectCode.FAILED_PRECONDITION
    assert "nodes.3: this node (not set), 3 'p=9'" in ready.rejection.message
