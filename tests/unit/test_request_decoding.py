"""A request that does not parse as its message type is refused as INVALID_ARGUMENT.

Found by the request fuzzer (tests/fuzz): grpcio parses a request before the handler runs
and answered bytes that do not parse with ``UNKNOWN "Unexpected <class 'DecodeError'>"``
and a logged traceback; UNKNOWN means "may or may not have happened", so the gateway
retried it and a client would too. Real services in process on loopback
(tests/fuzz/targets.py): the replica and the gateway in front of it, a unary call and a
client stream whose second message is garbage; the node still serves afterwards. Also a
request that parses but carries an enum value the gateway does not know (a newer
client's `SubscribeRequest.read_from`): refused, not guessed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from squall.v1 import broker_pb2, common_pb2
from tests.fuzz.harness import Raw, methods, outcome
from tests.fuzz.targets import FullNode

_GARBAGE = b"\xff\xff\xff"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullNode]:
    full = FullNode(Path(tmp_path_factory.mktemp("decoding")))
    try:
        yield full
    finally:
        full.close()


def _method(service: str, name: str):  # type: ignore[no-untyped-def]
    return next(m for m in methods(broker_pb2.DESCRIPTOR, service) if m.name == name)


@pytest.mark.parametrize("via", ["replica", "gateway"])
def test_garbage_bytes_are_invalid_argument_not_unknown(node: FullNode, via: str) -> None:
    channel = node.replica_channel if via == "replica" else node.gateway_channel
    result = outcome(channel, _method("TopicManager", "RetrieveTopic"), [Raw(_GARBAGE)])
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT, result
    assert "/squall.v1.TopicManager/RetrieveTopic" in result.details
    assert "does not parse" in result.details
    assert "after 2 attempts" not in result.details  # a definite refusal is not retried

    good = broker_pb2.PublishRequest(topic="fz", events=[common_pb2.EventData(payload=b"x")])
    stream = outcome(channel, _method("Publisher", "PublishStream"), [good, Raw(_GARBAGE)])
    assert stream.code == grpc.StatusCode.INVALID_ARGUMENT, stream
    assert "does not parse" in stream.details
    assert node.check() == []


def test_a_subscribe_with_an_unknown_read_from_is_refused_by_the_gateway(node: FullNode) -> None:
    subscribe = _method("Subscriber", "Subscribe")
    unknown = broker_pb2.SubscribeRequest(
        topic="keep.seed", start=broker_pb2.START_POSITION_EARLIEST
    )
    unknown.read_from = 99  # type: ignore[assignment]  # a value a newer client may send
    result = outcome(node.gateway_channel, subscribe, [unknown])
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT, result
    assert "SubscribeRequest.read_from" in result.details
    assert "unknown value 99" in result.details
    assert result.responses == 0
    # The same read with a known value is served.
    known = broker_pb2.SubscribeRequest(
        topic="keep.seed",
        start=broker_pb2.START_POSITION_EARLIEST,
        read_from=broker_pb2.READ_FROM_REPLICAS,
    )
    served = outcome(node.gateway_channel, subscribe, [known])
    assert served.code == grpc.StatusCode.OK and served.responses > 0, served
    assert node.check() == []
