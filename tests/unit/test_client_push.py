"""The client's push pieces: the subscribe request it builds and the in-process endpoint.

Goals: `subscribe_push` sends IceStorm's QoS keys with the caller's values and refuses a
bad start before sending; a `PushEndpoint` answers a probe for an id it hosts, NOT_FOUND
for one it does not (the cluster removes that subscription at once), hands each batch to
the id's callback as `Message`s, and turns a raising callback into a failed delivery.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

import squall
from squall._push import subscribe_push_request
from squall.v1 import broker_pb2, common_pb2, push_pb2, push_pb2_grpc


def test_the_request_carries_icestorm_qos_and_the_start() -> None:
    request = subscribe_push_request("t", "s", "h:1", "ordered", -1, "earliest", None)
    assert dict(request.qos) == {"reliability": "ordered", "retryCount": "-1"}
    assert request.start == broker_pb2.START_POSITION_EARLIEST
    request = subscribe_push_request("t", "s", "h:1", "", 0, 17, {"retry_count": "2"})
    # The other spelling given explicitly wins; the cluster gets one of the two.
    assert dict(request.qos) == {"reliability": "", "retry_count": "2"}
    assert (request.start, request.offset) == (broker_pb2.START_POSITION_OFFSET, 17)
    request = subscribe_push_request("t", "s", "h:1", "", 0, "latest", {"color": "red"})
    assert request.qos["color"] == "red"  # sent as given: the cluster names it unknown
    assert request.start == broker_pb2.START_POSITION_LATEST


@pytest.mark.parametrize("start", ["middle", -1, True, 1.5])
def test_a_bad_start_is_refused_before_sending(start: object) -> None:
    with pytest.raises(ValueError, match="start must be"):
        subscribe_push_request("t", "s", "h:1", "", 0, start, None)  # type: ignore[arg-type]


@pytest.fixture
def endpoint() -> Iterator[squall.PushEndpoint]:
    with squall.PushEndpoint("127.0.0.1:0") as serving:
        yield serving


@pytest.fixture
def stub(endpoint: squall.PushEndpoint) -> Iterator[push_pb2_grpc.PushSubscriberStub]:
    with grpc.insecure_channel(endpoint.address) as channel:
        yield push_pb2_grpc.PushSubscriberStub(channel)


def _events(*offsets: int) -> list[common_pb2.Event]:
    return [
        common_pb2.Event(topic="t", offset=o, payload=b"p%d" % o, headers={"h": "v"})
        for o in offsets
    ]


def test_probe_and_delivery_reach_the_ids_callback(
    endpoint: squall.PushEndpoint, stub: push_pb2_grpc.PushSubscriberStub
) -> None:
    got: list[squall.PushDelivery] = []
    lock = threading.Lock()

    def handle(delivery: squall.PushDelivery) -> None:
        with lock:
            got.append(delivery)

    endpoint.add("s1", handle)
    stub.Deliver(push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", probe=True), timeout=5)
    assert got == []  # a probe is answered, not delivered
    stub.Deliver(
        push_pb2.PushDeliverRequest(
            topic="t", subscriber_id="s1", events=_events(4, 5), attempt=2, master_id="n2", epoch=7
        ),
        timeout=5,
    )
    [delivery] = got
    assert (delivery.topic, delivery.subscriber_id, delivery.attempt) == ("t", "s1", 2)
    assert (delivery.master_id, delivery.epoch) == ("n2", 7)
    assert [(m.offset, m.payload, dict(m.headers)) for m in delivery.messages] == [
        (4, b"p4", {"h": "v"}),
        (5, b"p5", {"h": "v"}),
    ]


def test_an_id_not_hosted_is_not_found(
    endpoint: squall.PushEndpoint, stub: push_pb2_grpc.PushSubscriberStub
) -> None:
    endpoint.add("s1", lambda delivery: None)
    assert endpoint.remove("s1") and not endpoint.remove("s1")
    for probe in (True, False):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Deliver(
                push_pb2.PushDeliverRequest(
                    topic="t", subscriber_id="s1", probe=probe, events=_events(0)
                ),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no push subscriber 's1'" in (caught.value.details() or "")


def test_a_raising_callback_fails_the_delivery(
    endpoint: squall.PushEndpoint, stub: push_pb2_grpc.PushSubscriberStub
) -> None:
    def broken(delivery: squall.PushDelivery) -> None:
        raise RuntimeError("database down")

    endpoint.add("s1", broken)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Deliver(
            push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", events=_events(0)),
            timeout=5,
        )
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "database down" in (caught.value.details() or "")


def test_a_bad_bind_is_refused() -> None:
    with pytest.raises(ValueError, match="host:port"):
        squall.PushEndpoint("7300")
    with pytest.raises(ValueError, match="max_workers"):
        squall.PushEndpoint(max_workers=0)


def test_advertise_overrides_the_address() -> None:
    with squall.PushEndpoint("127.0.0.1:0", advertise="subscriber.example:7300") as serving:
        assert serving.address == "subscriber.example:7300"
