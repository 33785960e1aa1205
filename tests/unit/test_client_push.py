"""The client's push pieces: the subscribe request it builds and the in-process endpoint.

Goals: `subscribe_push` sends IceStorm's QoS keys with the caller's values and refuses a
bad start before sending; a `PushEndpoint` answers a probe for an id it hosts, NOT_FOUND
for one it does not (the cluster removes that subscription at once), hands each batch to
the id's callback as `Message`s, and turns a raising callback into a failed delivery;
on its delivery stream (`DeliverStream`, threaded and asyncio) it answers each request
with the status Deliver would have, and the threaded one keeps a thread for Deliver calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

import squall
import squall.aio
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


def _requests(*requests: push_pb2.PushDeliverRequest) -> Iterator[push_pb2.PushDeliverRequest]:
    yield from requests


def test_the_delivery_stream_answers_each_request_as_deliver_would(
    endpoint: squall.PushEndpoint, stub: push_pb2_grpc.PushSubscriberStub
) -> None:
    got: list[list[int]] = []
    endpoint.add("s1", lambda delivery: got.append([m.offset for m in delivery.messages]))

    def broken(delivery: squall.PushDelivery) -> None:
        raise RuntimeError("database down")

    endpoint.add("s2", broken)
    results = list(
        stub.DeliverStream(
            _requests(
                push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", probe=True),
                push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", events=_events(4, 5)),
                push_pb2.PushDeliverRequest(topic="t", subscriber_id="gone", events=_events(6)),
                push_pb2.PushDeliverRequest(topic="t", subscriber_id="s2", events=_events(6)),
                push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", events=_events(6)),
            ),
            timeout=5,
        )
    )
    assert [grpc.StatusCode.OK.value[0]] * 2 == [r.code for r in results[:2]]
    assert results[2].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "no push subscriber 'gone'" in results[2].details
    assert results[3].code == grpc.StatusCode.INTERNAL.value[0]
    assert "database down" in results[3].details
    assert results[4].code == grpc.StatusCode.OK.value[0]
    assert got == [[4, 5], [6]]


def test_streams_leave_a_thread_for_deliver_calls() -> None:
    """Each open stream holds a server thread: with max_workers=2, one stream at a time."""
    with (
        squall.PushEndpoint(max_workers=2) as serving,
        grpc.insecure_channel(serving.address) as channel,
    ):
        stub = push_pb2_grpc.PushSubscriberStub(channel)
        serving.add("s1", lambda delivery: None)
        probe = push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", probe=True)
        more = threading.Event()

        def held() -> Iterator[push_pb2.PushDeliverRequest]:
            yield probe
            more.wait(5)

        first = stub.DeliverStream(held(), timeout=10)
        assert next(first).code == grpc.StatusCode.OK.value[0]  # open, its thread held
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.DeliverStream(_requests(probe), timeout=5))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stub.Deliver(probe, timeout=5)  # the thread left
        more.set()
        assert list(first) == []
        # The first stream's thread is back: a stream is served again.
        assert [r.code for r in stub.DeliverStream(_requests(probe), timeout=5)] == [0]


def test_the_asyncio_endpoint_serves_the_delivery_stream() -> None:
    got: list[list[int]] = []

    async def handle(delivery: squall.PushDelivery) -> None:
        got.append([m.offset for m in delivery.messages])

    async def scenario() -> list[push_pb2.PushDeliverResult]:
        async with squall.aio.PushEndpoint() as serving:
            serving.add("s1", handle)
            async with grpc.aio.insecure_channel(serving.address) as channel:
                call = push_pb2_grpc.PushSubscriberStub(channel).DeliverStream(timeout=5)
                out = []
                for request in (
                    push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", events=_events(1)),
                    push_pb2.PushDeliverRequest(topic="t", subscriber_id="s9", events=_events(2)),
                ):
                    await call.write(request)
                    out.append(await call.read())
                await call.done_writing()
                return out

    results = asyncio.run(scenario())
    assert [r.code for r in results] == [0, grpc.StatusCode.NOT_FOUND.value[0]]
    assert got == [[1]]


def test_close_ends_a_waiting_delivery_stream_and_lets_one_in_progress_finish() -> None:
    """A master keeps a delivery stream open per subscriber: close() ends one waiting for
    its next request at once instead of holding for the grace, and a delivery in
    progress on another still finishes and is answered."""
    with squall.PushEndpoint() as serving, grpc.insecure_channel(serving.address) as channel:
        stub = push_pb2_grpc.PushSubscriberStub(channel)
        release, delivered = threading.Event(), threading.Event()

        def slow(delivery: squall.PushDelivery) -> None:
            delivered.set()
            release.wait(30)

        serving.add("idle", lambda delivery: None)
        serving.add("busy", slow)
        hold = threading.Event()

        def requests(subscriber_id: str, **fields: object) -> Iterator[push_pb2.PushDeliverRequest]:
            yield push_pb2.PushDeliverRequest(topic="t", subscriber_id=subscriber_id, **fields)
            hold.wait(30)

        idle = stub.DeliverStream(requests("idle", probe=True), timeout=60)
        assert next(idle).code == grpc.StatusCode.OK.value[0]
        busy = stub.DeliverStream(requests("busy", events=_events(7)), timeout=60)
        assert delivered.wait(10)
        closing = threading.Thread(target=serving.close, kwargs={"grace_s": 60.0})
        closing.start()
        with pytest.raises(grpc.RpcError) as ended:
            next(idle)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert closing.is_alive()  # the delivery in progress has its grace
        release.set()
        assert next(busy).code == grpc.StatusCode.OK.value[0]
        closing.join(10)
        assert not closing.is_alive()
        hold.set()


def test_the_asyncio_endpoint_ends_a_waiting_delivery_stream_on_close() -> None:
    async def handle(delivery: squall.PushDelivery) -> None:
        pass

    async def scenario() -> tuple[bool, grpc.StatusCode]:
        serving = squall.aio.PushEndpoint()
        await serving.start()
        serving.add("s1", handle)
        async with grpc.aio.insecure_channel(serving.address) as channel:
            call = push_pb2_grpc.PushSubscriberStub(channel).DeliverStream(timeout=60)
            await call.write(push_pb2.PushDeliverRequest(topic="t", subscriber_id="s1", probe=True))
            assert (await call.read()).code == grpc.StatusCode.OK.value[0]
            # Within the test's bound, not the 60 s grace: the stream waited, idle.
            await asyncio.wait_for(serving.close(grace_s=60.0), 10)
            return await call.read() is grpc.aio.EOF, await call.code()

    assert asyncio.run(scenario()) == (True, grpc.StatusCode.OK)
