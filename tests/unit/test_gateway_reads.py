"""Which replica serves a Subscribe the gateway forwards (services/gateway/reads.py), the
group the views name (GroupViews.members), and the settings that ask for it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from squall._subscriber import subscribe_request
from squall.v1 import broker_pb2, common_pb2, coordinator_pb2
from squall_server.common.config import ConfigError, parse_config
from squall_server.gateway.master import GroupViews
from squall_server.gateway.reads import ReadSpread, Replica, UnknownReadFrom, spreads
from tests.unit.test_config import VALID

N1, N2, N3 = Replica("n1", "h:1"), Replica("n2", "h:2"), Replica("n3", "h:3")


def test_the_choice_is_pure() -> None:
    source = Path(__file__).resolve().parents[2] / "services" / "gateway" / "reads.py"
    imported = {
        alias.name
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert not imported & {"grpc", "asyncio", "time", "random", "threading"}


def test_readers_go_to_slaves_first_then_spread_evenly_and_come_back_when_closed() -> None:
    spread = ReadSpread()
    chosen = []
    for _ in range(6):
        replica = spread.choose([N1, N2, N3], master_id="n1")
        assert replica is not None
        spread.opened(replica.node_id)
        chosen.append(replica.node_id)
    assert chosen == ["n2", "n3", "n1", "n2", "n3", "n1"]
    spread.closed("n3")
    spread.closed("n3")
    assert spread.open_reads("n3") == 0
    assert spread.choose([N1, N2, N3], master_id="n1") == N3
    # A closed count never goes below zero (a stream ended twice is not a free slot).
    spread.closed("n3")
    assert spread.open_reads("n3") == 0


def test_no_members_no_choice() -> None:
    assert ReadSpread().choose([], master_id="") is None


def test_the_request_overrides_the_gateway_setting() -> None:
    assert spreads(broker_pb2.READ_FROM_REPLICAS, "master")
    assert not spreads(broker_pb2.READ_FROM_MASTER, "replicas")
    assert spreads(broker_pb2.READ_FROM_UNSPECIFIED, "replicas")
    assert not spreads(broker_pb2.READ_FROM_UNSPECIFIED, "master")


@pytest.mark.parametrize("default", ["master", "replicas"])
def test_a_read_from_the_gateway_does_not_know_is_refused_not_guessed(default: str) -> None:
    # A newer client's value (proto3 enums are open) used to fall back to the gateway's
    # default, sending the reader where it may have asked not to go.
    with pytest.raises(UnknownReadFrom) as refused:
        spreads(99, default)
    assert "SubscribeRequest.read_from" in str(refused.value)
    assert "unknown value 99" in str(refused.value)
    assert "READ_FROM_REPLICAS" in str(refused.value)


def _view(node: str, epoch: int, master: str, members: list[str]) -> coordinator_pb2.GroupView:
    view = coordinator_pb2.GroupView(
        node_id=node, state=common_pb2.NODE_STATE_NORMAL, epoch=epoch, group_name="g"
    )
    view.master.node_id = master
    for member in members:
        view.members.add(node_id=member)
    return view


def test_the_group_is_the_master_then_its_configured_members() -> None:
    views = GroupViews({"n1": "h:1", "n2": "h:2", "n3": "h:3"})
    views.observe("n2", _view("n2", 4, "n2", ["n3", "n2", "n1", "unknown"]))
    assert views.members == ("n2", "n1", "n3")
    # n1 died: the next group leaves it out, and a stale view of an older epoch loses.
    views.observe("n2", _view("n2", 5, "n2", ["n2", "n3"]))
    views.observe("n3", _view("n3", 4, "n2", ["n1", "n2", "n3"]))
    assert views.members == ("n2", "n3")
    views.forget("n2")
    views.forget("n3")
    assert views.master is None and views.members == ()


def test_gateway_read_from_setting() -> None:
    config = parse_config(
        VALID.replace(
            'address = "127.0.0.1:7100"', 'address = "127.0.0.1:7100"\nread_from = "replicas"'
        ),
        Path("/etc/squall/s.toml"),
    )
    assert config.gateways[0].read_from == "replicas"
    assert parse_config(VALID, Path("/etc/squall/s.toml")).gateways[0].read_from == "master"
    with pytest.raises(ConfigError) as caught:
        parse_config(
            VALID.replace(
                'address = "127.0.0.1:7100"', 'address = "127.0.0.1:7100"\nread_from = "slaves"'
            ),
            Path("/etc/squall/s.toml"),
        )
    assert str(caught.value) == (
        "gateways[0].read_from (gateway 'g1'): must be one of 'master', 'replicas', got 'slaves'"
    )


def test_the_library_asks_for_replicas_or_the_master_or_leaves_it_to_the_gateway() -> None:
    assert subscribe_request("t", None, "earliest", True, 0).read_from == 0
    assert (
        subscribe_request("t", None, "earliest", True, 0, read_from="replicas").read_from
        == broker_pb2.READ_FROM_REPLICAS
    )
    assert (
        subscribe_request("t", "s", "earliest", True, 0, read_from="master").read_from
        == broker_pb2.READ_FROM_MASTER
    )
    with pytest.raises(ValueError, match="read_from must be one of 'master', 'replicas'"):
        subscribe_request("t", None, "earliest", True, 0, read_from="slave")  # type: ignore[arg-type]
