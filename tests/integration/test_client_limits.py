"""Per-client limits against real processes (docs/configuration.md, "Limits a client meets").

Goal: one client cannot hold more than limits.client_streams_max streams open, at the
gateway or at a replica, and hitting the limit says so by name without hurting another
client; a call whose metadata is over limits.metadata_bytes_max is refused; a subscriber
reads a topic of events near max_event_bytes although a batch of them would not fit in
one gRPC message (limits.max_batch_bytes bounds each response).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, wait_for

pytestmark = pytest.mark.integration

STREAMS_MAX = 3
MiB = 1024 * 1024
MESSAGE_BYTES_MAX = 4 * MiB
BATCH_BYTES_MAX = 3 * MiB


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One single-node cluster with low client limits, shared by this module."""
    cluster = make_cluster(
        ROOT / "deploy" / "single.toml",
        tmp_path_factory.mktemp("limits"),
        limits={
            "client_streams_max": STREAMS_MAX,
            "metadata_bytes_max": 4096,
            "max_message_bytes": MESSAGE_BYTES_MAX,
            "max_batch_bytes": BATCH_BYTES_MAX,
            "push_batch_max_bytes": BATCH_BYTES_MAX,
            "replication_inflight_bytes_max": MESSAGE_BYTES_MAX,
        },
    )
    try:
        cluster.start_all()
        with squall.connect(cluster.gateway_address) as client:
            client.create_topic("limited")
            with client.topic("limited").publisher() as publisher:
                publisher.publish(b"first")
                publisher.flush()
        yield cluster
    finally:
        cluster.stop_all()


def _open_stream(channel: grpc.Channel) -> Iterator[broker_pb2.SubscribeResponse]:
    """A following Subscribe stream, known to be running once its first event arrived."""
    call = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
        broker_pb2.SubscribeRequest(
            topic="limited", start=broker_pb2.START_POSITION_EARLIEST, follow=True
        ),
        timeout=30,
    )
    next(call)
    return call


def _own_connection(address: str) -> grpc.Channel:
    # Channels in one process share a connection unless told otherwise.
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.mark.parametrize("where", ["gateway", "replica"])
def test_streams_per_client_are_bounded_by_name(limited: LocalCluster, where: str) -> None:
    address = limited.gateway_address if where == "gateway" else limited.replica_address("n1")
    with _own_connection(address) as channel, _own_connection(address) as other:
        streams = [_open_stream(channel) for _ in range(STREAMS_MAX)]
        with pytest.raises(grpc.RpcError) as refused:
            _open_stream(channel)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            f"this client already has {STREAMS_MAX} streams open: "
            f"limits.client_streams_max is {STREAMS_MAX}"
        )
        # Another client is not affected.
        _open_stream(other).cancel()  # type: ignore[attr-defined]
        # A closed stream frees its place (the server notices the cancel shortly after).
        streams.pop().cancel()  # type: ignore[attr-defined]
        opened: list[object] = []

        def reopened() -> bool:
            try:
                opened.append(_open_stream(channel))
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            return True

        wait_for(reopened, 10, "a stream slot freed by a cancelled stream")
        for stream in [*streams, *opened]:
            stream.cancel()  # type: ignore[attr-defined]


def test_metadata_over_the_limit_is_refused(limited: LocalCluster) -> None:
    with _own_connection(limited.gateway_address) as channel:
        stub = broker_pb2_grpc.TopicManagerStub(channel)
        fits = stub.ListTopics(
            broker_pb2.ListTopicsRequest(), metadata=(("x-app", "a" * 1000),), timeout=5
        )
        assert "limited" in [t.name for t in fits.topics]
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListTopics(
                broker_pb2.ListTopicsRequest(), metadata=(("x-app", "a" * 8000),), timeout=5
            )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


def test_a_topic_of_large_events_is_read_in_responses_that_fit_one_message(
    limited: LocalCluster,
) -> None:
    # ~10 MiB: never one message. 1000 bytes short of 1 MiB leaves room for the rest of
    # each event (ids, topic, headers), which the response byte budget counts too.
    payloads = [bytes([i]) * (MiB - 1000) for i in range(10)]
    with squall.connect(limited.gateway_address) as client:
        client.create_topic("large")
        topic = client.topic("large")
        with topic.publisher() as publisher:
            for payload in payloads:
                publisher.publish(payload)
        read = [m.payload for m in topic.subscribe(start="earliest", follow=False)]
        assert read == payloads
    # What each response holds, through the gateway and straight from the replica: the
    # server's limit, or less when the reader asks for less (at least one event).
    for address in (limited.gateway_address, limited.replica_address("n1")):
        with _own_connection(address) as channel:
            stub = broker_pb2_grpc.SubscriberStub(channel)
            for asked, per_response in ((0, BATCH_BYTES_MAX // (MiB - 1000)), (1, 1)):
                responses = list(
                    stub.Subscribe(
                        broker_pb2.SubscribeRequest(
                            topic="large",
                            start=broker_pb2.START_POSITION_EARLIEST,
                            max_batch_bytes=asked,
                        ),
                        timeout=30,
                    )
                )
                sizes = [len(r.events) for r in responses]
                assert sum(sizes) == len(payloads) and max(sizes) == per_response, sizes
