"""Who may make the internal calls, judged from the names on the caller's certificate.

The interceptor itself runs in tests/integration/test_tls.py with real processes; these
cases cover every rule of its table.
"""

from __future__ import annotations

import grpc
import pytest

from squall.v1 import coordinator_pb2, replica_pb2
from squall_server.common.config import parse_config
from squall_server.common.peer_guard import PeerGuard, Refused, guards
from squall_server.common.running_nodes import RunningNodes
from squall_server.common.tls import Transport, address_owner, handshake_failure
from tests.unit.test_config import VALID

DELIVER = "/squall.v1.Coordinator/Deliver"
REPLICATE = "/squall.v1.Replication/Replicate"
FETCH = "/squall.v1.Replication/FetchLog"
SET_ROLE = "/squall.v1.ReplicaControl/SetRole"
FREEZE = "/squall.v1.ReplicaControl/FreezeForShutdown"
STATE = "/squall.v1.ReplicaControl/GetReplicaState"


@pytest.fixture
def guard() -> PeerGuard:
    """n1's guard in VALID's cluster (nodes n1..n3, gateway g1)."""
    return PeerGuard(parse_config(VALID, "cluster.toml"), "n1", "replica")


def _names(*names: str) -> frozenset[str]:
    return frozenset({*names, "localhost", "127.0.0.1"})


def _refused(guard: PeerGuard, method: str, names: frozenset[str], request: object) -> Refused:
    with pytest.raises(Refused) as refused:
        guard.check(method, names, request)
    return refused.value


def test_a_call_without_a_certificate_is_unauthenticated(guard: PeerGuard) -> None:
    refused = _refused(guard, DELIVER, frozenset(), coordinator_pb2.PeerMessage(from_node="n2"))
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED
    assert "needs a client certificate" in refused.message


def test_a_node_delivers_as_itself_only(guard: PeerGuard) -> None:
    assert guard.check(DELIVER, _names("n2"), coordinator_pb2.PeerMessage(from_node="n2")) == "n2"
    refused = _refused(guard, DELIVER, _names("n2"), coordinator_pb2.PeerMessage(from_node="n3"))
    assert refused.code == grpc.StatusCode.PERMISSION_DENIED
    assert refused.message == (
        "Coordinator/Deliver: the client certificate names node n2 but the message's sender is 'n3'"
    )


def test_gateways_and_admin_cannot_replicate(guard: PeerGuard) -> None:
    hello = replica_pb2.ReplicateRequest(hello=replica_pb2.ReplicationHello(master_id="n2"))
    assert guard.check(REPLICATE, _names("n2"), hello) == "n2"
    assert _refused(guard, REPLICATE, _names("n3"), hello).code == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    for caller in ("g1", "admin", "app"):
        refused = _refused(guard, REPLICATE, _names(caller), hello)
        assert refused.message.startswith("Replication/Replicate is for cluster nodes"), caller
    fetch = replica_pb2.FetchLogRequest(node_id="n3")
    assert guard.check(FETCH, _names("n3"), fetch) == "n3"
    assert "message's node is 'n3'" in _refused(guard, FETCH, _names("n2"), fetch).message


def test_a_certificate_naming_two_nodes_is_refused(guard: PeerGuard) -> None:
    message = coordinator_pb2.PeerMessage(from_node="n2")
    assert _refused(guard, DELIVER, _names("n2", "n3"), message).code == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_role_commands_come_from_the_own_nodes_coordinator(guard: PeerGuard) -> None:
    assert guard.check(SET_ROLE, _names("n1"), replica_pb2.RoleCommand()) == "n1"
    for caller in ("n2", "g1", "admin"):
        refused = _refused(guard, SET_ROLE, _names(caller), replica_pb2.RoleCommand())
        assert "only from node n1's own coordinator" in refused.message


def test_shutdown_and_state_calls_admit_the_operator(guard: PeerGuard) -> None:
    assert guard.check(FREEZE, _names("admin"), None) is None
    assert guard.check(FREEZE, _names("n2"), None) == "n2"
    assert _refused(guard, FREEZE, _names("g1"), None).code == grpc.StatusCode.PERMISSION_DENIED
    assert guard.check(STATE, _names("g1"), None) == "g1"
    assert guard.check(STATE, _names("admin"), None) is None
    assert _refused(guard, STATE, _names("app"), None).code == grpc.StatusCode.PERMISSION_DENIED


def test_members_are_found_by_address_and_handshake_failures_are_recognised() -> None:
    config = parse_config(VALID, "cluster.toml")
    assert address_owner(config, "127.0.0.1:7202") == "n2"
    assert address_owner(config, "127.0.0.1:7103") == "n3"
    assert address_owner(config, config.gateways[0].address) == "g1"
    assert address_owner(config, "127.0.0.1:9999") is None
    assert handshake_failure(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
        "Ssl handshake failed: SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED"
    )
    assert handshake_failure("Custom verification check failed: Hostname Verification Check")
    assert not handshake_failure("failed to connect: Connection refused")


def test_tls_off_builds_plaintext_servers_and_no_guard() -> None:
    config = parse_config(VALID, "cluster.toml")
    assert Transport(config, "n1").server_credentials(require_client_cert=True) is None
    assert guards(config, "n1", "replica") == []


def test_the_guard_follows_the_running_node_set() -> None:
    """A node added at runtime is taken as a node as soon as the running set names it,
    a removed one is refused from then on, with no restart (RunningNodes)."""
    config = parse_config(VALID, "cluster.toml")
    running = RunningNodes((n.id for n in config.nodes), (g.id for g in config.gateways))
    guard = PeerGuard(config, "n1", "coordinator", nodes=running)
    hello = coordinator_pb2.PeerMessage(from_node="n4")
    assert _refused(guard, DELIVER, _names("n4"), hello).code == grpc.StatusCode.PERMISSION_DENIED
    assert running.follow(["n1", "n2", "n3", "n4"]) == (frozenset({"n4"}), frozenset())
    assert guard.check(DELIVER, _names("n4"), hello) == "n4"
    assert running.follow(["n1", "n2", "n4"]) == (frozenset(), frozenset({"n3"}))
    gone = coordinator_pb2.PeerMessage(from_node="n3")
    assert _refused(guard, DELIVER, _names("n3"), gone).code == grpc.StatusCode.PERMISSION_DENIED
    # No set known (empty): nothing changes; gateways stay members throughout.
    assert running.follow([]) == (frozenset(), frozenset())
    assert "g1" in running.members and "n4" in running.members
