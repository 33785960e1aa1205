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

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from squall.v1 import broker_pb2, common_pb2
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
