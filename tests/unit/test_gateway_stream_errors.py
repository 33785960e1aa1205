"""A publish stream the master ends early is never answered INTERNAL by the gateway.

Found by the request fuzzer (tests/fuzz): when the master refuses one request of a
PublishStream and ends the stream while the gateway is still forwarding the next request,
grpcio's aio client replaces the master's status with INTERNAL "Internal error from Core"
(grpc/grpc#36066), and the gateway relayed that to the app. It now answers either the
master's own refusal or UNKNOWN (may or may not have been applied: retry with the same
publisher id and sequence) with a message saying so. Real services in process on
loopback (tests/fuzz/targets.py), the same stream sent many times since it is a race.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.fuzz.harness import methods, outcome
from tests.fuzz.targets import FullNode

_ROUNDS = 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullNode]:
    full = FullNode(Path(tmp_path_factory.mktemp("gateway-stream")))
    try:
        yield full
    finally:
        full.close()


def test_a_stream_refused_midway_is_answered_with_the_refusal_or_unknown(node: FullNode) -> None:
    [stream] = [m for m in methods(broker_pb2.DESCRIPTOR, "Publisher") if m.name == "PublishStream"]
    requests = [
        broker_pb2.PublishRequest(topic="fz", events=[common_pb2.EventData(payload=b"x")]),
        *[broker_pb2.PublishRequest(topic="no-such-topic")] * 3,
    ]
    seen = set()
    for _ in range(_ROUNDS):
        result = outcome(node.gateway_channel, stream, list(requests))
        seen.add(result.code)
        assert result.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN), result
        if result.code == grpc.StatusCode.NOT_FOUND:
            assert "no-such-topic" in result.details
        else:
            assert "may or may not have been applied" in result.details
    assert grpc.StatusCode.NOT_FOUND in seen


def test_unary_publishes_sharing_the_masters_stream_each_get_their_own_answer(
    node: FullNode,
) -> None:
    # The gateway carries deduplicated unary publishes from many callers as requests of
    # one stream to the master. Each caller must get the response to its own request (the
    # receipt names the offset where its own event is stored), and a refused request
    # (a missing topic) gets its own refusal without costing another caller its event or
    # its answer (the master answers it inline and the stream goes on).
    topics = broker_pb2_grpc.TopicManagerStub(node.gateway_channel)
    topics.CreateTopic(broker_pb2.CreateTopicRequest(name="links"), timeout=10)
    stub = broker_pb2_grpc.PublisherStub(node.gateway_channel)

    def publish(caller: int, sequence: int) -> tuple[int, int, object]:
        bad = caller % 8 == 7 and sequence % 5 == 0
        request = broker_pb2.PublishRequest(
            topic="no-such-topic" if bad else "links",
            publisher_id=f"caller-{caller}",
            events=[common_pb2.EventData(payload=b"x", sequence=sequence)],
        )
        try:
            return caller, sequence, stub.Publish(request, timeout=20).receipts[0]
        except grpc.RpcError as exc:
            return caller, sequence, exc

    callers, per_caller = 16, 25

    def run(caller: int) -> list[tuple[int, int, object]]:
        return [publish(caller, sequence) for sequence in range(1, per_caller + 1)]

    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        results = [r for batch in pool.map(run, range(callers)) for r in batch]
    stored: dict[int, tuple[str, int]] = {}
    stream = broker_pb2_grpc.SubscriberStub(node.gateway_channel).Subscribe(
        broker_pb2.SubscribeRequest(topic="links", start=broker_pb2.START_POSITION_EARLIEST),
        timeout=10,
    )
    expected = sum(1 for _, _, r in results if isinstance(r, common_pb2.AckReceipt))
    for response in stream:
        stored.update((e.offset, (e.publisher_id, e.sequence)) for e in response.events)
        if len(stored) >= expected:
            stream.cancel()
            break
    refused = 0
    for caller, sequence, result in results:
        bad = caller % 8 == 7 and sequence % 5 == 0
        if bad:
            assert isinstance(result, grpc.RpcError), (caller, sequence, result)
            # Its own refusal, answered inline on the shared stream: exact and definite.
            assert result.code() == grpc.StatusCode.NOT_FOUND, result
            assert "no-such-topic" in (result.details() or "")
            refused += 1
            continue
        assert isinstance(result, common_pb2.AckReceipt), (caller, sequence, result)
        assert stored.get(result.offset) == (f"caller-{caller}", sequence), (caller, sequence)
    assert refused == 2 * 5
    # Each good event is stored once: the topic holds exactly as many events.
    topic = topics.RetrieveTopic(broker_pb2.RetrieveTopicRequest(name="links"), timeout=10).topic
    assert topic.next_offset - topic.first_offset == callers * per_caller - refused
