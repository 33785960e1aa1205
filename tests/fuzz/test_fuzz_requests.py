"""Any request a client or a hostile peer can send gets a clear answer (issue 9, item 4).

Every RPC of every service is called with generated requests (any message of its request
type: extreme numbers, odd and oversized strings, invalid UTF-8 bytes, unknown enum
values, nested and repeated fields, oneofs) and with random bytes that parse as that type,
plus hostile call metadata. The property, per call: it ends OK or with a status other
than INTERNAL that carries a message, no handler raises an unhandled exception (checked
on the wire and in the log), and afterwards the service still answers its health check
and a simple call. On the one-node cluster the events committed before fuzzing are still
read back exactly; after each group of RPCs the store passes its own consistency check
(every log entry and state record read back and checksummed).

Targets (tests/fuzz/targets.py): client-facing services through the gateway and directly
at the replica, the cluster-status view, the coordinator's peer and operator RPCs, and
the replica's internal ReplicaControl and Replication services as a peer reaches them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from squall.v1 import broker_pb2, coordinator_pb2, gateway_pb2, replica_pb2
from squall_server.replica.node import UNREACHABLE_KEY
from tests.fuzz.harness import Method, Raw, methods, outcome, problem
from tests.fuzz.proto_strategies import messages, parsed_bytes
from tests.fuzz.targets import (
    PEER_CLUSTER_ID,
    PEER_EPOCH,
    SEED_PAYLOADS,
    FullNode,
    LoneCoordinator,
    PeerReplica,
    verify_store,
)

_BROKER_SERVICES = ("TopicManager", "Publisher", "Subscriber", "PushSubscriptions")
CLIENT_METHODS = [m for s in _BROKER_SERVICES for m in methods(broker_pb2.DESCRIPTOR, s)]
ADMIN_METHODS = methods(gateway_pb2.DESCRIPTOR, "ClusterAdmin")
PEER_METHODS = methods(replica_pb2.DESCRIPTOR, "ReplicaControl") + methods(
    replica_pb2.DESCRIPTOR, "Replication"
)
COORDINATOR_METHODS = methods(coordinator_pb2.DESCRIPTOR, "Coordinator")
# Read-only internal RPCs that are safe to fuzz on the serving one-node cluster.
_READ_ONLY = {"GetReplicaState", "FetchLog", "GetStatus", "WatchGroupView"}

METADATA = st.lists(
    st.tuples(
        st.sampled_from(
            [UNREACHABLE_KEY, "traceparent", "tracestate", "authorization", "x-squall-odd"]
        ),
        st.one_of(
            st.sampled_from(["", ",", ",,,", "127.0.0.1:1,127.0.0.1:2", "00-zz-zz-01", "x" * 4000]),
            st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60),
        ),
    ),
    max_size=3,
)


# How the calls ended, per method and status: `FUZZ_STATS=1` prints it (docs/fuzzing.md).
STATS: Counter[tuple[str, str]] = Counter()


# Bytes that need not parse at all: the server must refuse them itself.
RAW = st.binary(max_size=64).map(Raw)


def _requests(method: Method) -> st.SearchStrategy[list[Message | Raw]]:
    """One request, or a stream of them for a client-streaming method."""
    one = st.one_of(messages(method.request), parsed_bytes(method.request), RAW)
    if method.client_streaming:
        return st.lists(one, min_size=0, max_size=4)
    return one.map(lambda request: [request])


def _hello() -> st.SearchStrategy[Message]:
    """A Hello the peer replica accepts (from n1, its master's epoch) or a near miss."""
    return st.builds(
        lambda master, epoch, cluster: replica_pb2.ReplicateRequest(
            hello=replica_pb2.ReplicationHello(master_id=master, epoch=epoch, cluster_id=cluster)
        ),
        st.sampled_from(["n1", "n1", "n3", "", "n2"]),
        st.sampled_from([PEER_EPOCH, PEER_EPOCH, PEER_EPOCH + 1, 0, 2**64 - 1]),
        st.sampled_from([PEER_CLUSTER_ID, PEER_CLUSTER_ID, "", "other"]),
    )


def _checksummed_entries() -> st.SearchStrategy[Message]:
    """Entry batches whose checksums hold, with fuzzed operations, LSNs and epochs, so the
    stream gets past the checksum to what applies an entry."""
    from squall_server.replica.store import make_entry

    entry = st.builds(
        make_entry,
        st.sampled_from([4, 5, 3, 1, 0, 2**64 - 1]),
        st.sampled_from([PEER_EPOCH, 1, PEER_EPOCH + 1, 0]),
        messages(replica_pb2.Operation.DESCRIPTOR, 3),
    )
    return st.builds(
        lambda entries, commit, epoch: replica_pb2.ReplicateRequest(
            entries=replica_pb2.EntryBatch(entries=entries, commit_lsn=commit, epoch=epoch)
        ),
        st.lists(entry, min_size=1, max_size=3),
        st.sampled_from([0, 3, 4, 2**64 - 1]),
        st.sampled_from([PEER_EPOCH, PEER_EPOCH + 1, 0]),
    )


def _replicate_streams() -> st.SearchStrategy[list[Message | Raw]]:
    any_request = st.one_of(
        RAW,
        messages(replica_pb2.ReplicateRequest.DESCRIPTOR),
        parsed_bytes(replica_pb2.ReplicateRequest.DESCRIPTOR),
        _checksummed_entries(),
    )
    return st.tuples(_hello(), st.lists(any_request, max_size=3)).map(
        lambda pair: [pair[0], *pair[1]]
    ) | st.lists(any_request, max_size=3)


def _assert_clear(
    target: FullNode | PeerReplica | LoneCoordinator,
    method: Method,
    requests: list[Message | Raw],
    metadata: list[tuple[str, str]],
    channel: grpc.Channel,
) -> None:
    result = outcome(channel, method, requests, tuple(metadata))
    STATS[(method.id, result.code.name)] += 1
    issues = [p for p in [problem(method, result)] if p] + target.check()
    shown = [f"{type(r).__name__} {str(r)[:300]!r}" for r in requests]
    assert not issues, "\n".join([*issues, f"requests: {shown}", f"metadata: {metadata}"])


# --- the one-node cluster: client-facing services, through the gateway and at the replica


@pytest.fixture(scope="module")
def full_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullNode]:
    node = FullNode(tmp_path_factory.mktemp("fuzz-full"))
    try:
        assert node.seed_payloads() == SEED_PAYLOADS
        yield node
    finally:
        node.close()


@pytest.mark.parametrize("method", CLIENT_METHODS, ids=lambda m: m.id)
@given(data=st.data())
def test_client_requests_through_the_gateway(
    full_node: FullNode, method: Method, data: st.DataObject
) -> None:
    requests = data.draw(_requests(method), label="requests")
    metadata = data.draw(METADATA, label="metadata")
    _assert_clear(full_node, method, requests, metadata, full_node.gateway_channel)


@pytest.mark.parametrize("method", CLIENT_METHODS, ids=lambda m: m.id)
@given(data=st.data())
def test_client_requests_straight_to_the_replica(
    full_node: FullNode, method: Method, data: st.DataObject
) -> None:
    requests = data.draw(_requests(method), label="requests")
    metadata = data.draw(METADATA, label="metadata")
    _assert_clear(full_node, method, requests, metadata, full_node.replica_channel)


@pytest.mark.parametrize(
    "method",
    ADMIN_METHODS + [m for m in PEER_METHODS + COORDINATOR_METHODS if m.name in _READ_ONLY],
    ids=lambda m: m.id,
)
@given(data=st.data())
def test_status_and_read_only_internal_requests(
    full_node: FullNode, method: Method, data: st.DataObject
) -> None:
    requests = data.draw(_requests(method), label="requests")
    channel = {
        "ClusterAdmin": full_node.gateway_channel,
        "Coordinator": full_node.coordinator_channel,
    }.get(method.service, full_node.replica_channel)
    _assert_clear(full_node, method, requests, [], channel)


def test_the_one_node_store_is_consistent_after_fuzzing(full_node: FullNode) -> None:
    assert full_node.seed_payloads() == SEED_PAYLOADS
    data_dir = full_node.data_dir
    full_node.close()
    topics, records = verify_store(data_dir)
    assert topics >= 2 and records > len(SEED_PAYLOADS)


# --- a peer replica: the internal services a hostile peer or coordinator can reach


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerReplica]:
    replica = PeerReplica(tmp_path_factory.mktemp("fuzz-peer"))
    try:
        yield replica
    finally:
        replica.close()


@pytest.mark.parametrize("method", PEER_METHODS, ids=lambda m: m.id)
@given(data=st.data())
def test_peer_requests_to_a_replica(peer: PeerReplica, method: Method, data: st.DataObject) -> None:
    if method.name == "Replicate":
        requests = data.draw(_replicate_streams(), label="stream")
    else:
        requests = data.draw(_requests(method), label="requests")
    _assert_clear(peer, method, requests, [], peer.channel_)


def test_the_peer_store_is_consistent_after_fuzzing(peer: PeerReplica) -> None:
    data_dir: Path = peer.data_dir
    peer.close()
    verify_store(data_dir)


# --- a coordinator: peer messages and operator controls


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoneCoordinator]:
    node = LoneCoordinator(tmp_path_factory.mktemp("fuzz-coordinator"))
    try:
        yield node
    finally:
        node.close()


@pytest.mark.parametrize("method", COORDINATOR_METHODS, ids=lambda m: m.id)
@given(data=st.data())
def test_peer_and_operator_requests_to_a_coordinator(
    coordinator: LoneCoordinator, method: Method, data: st.DataObject
) -> None:
    requests = data.draw(_requests(method), label="requests")
    _assert_clear(coordinator, method, requests, [], coordinator.channel_)
