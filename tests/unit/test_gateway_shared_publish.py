"""The gateway's shared publish stream to the master: who hears what (issue 16, item 2).

Goal: many callers' publishes share one stream, and each caller hears exactly what a call
of its own would have told it: its own response (never another's), its own refusal
(answered inline, or as the stream's status when the master ended the stream at its
request), "may or may not have been applied" for every request the stream left
unanswered, and a deadline. Back-pressure bounds the requests unanswered on the stream,
and a caller that gives up keeps its slot until the master answers.

In process, deterministic: the link's real code against a scripted stand-in for the
gRPC stream (what it was written, what it answers and when, how it ends).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.errors import INLINE_ERRORS, PUBLISH_ERRORS_KEY
from squall_server.gateway.master import Master
from squall_server.gateway.shared_publish import (
    Backlog,
    Joining,
    SharedPublishStream,
    SharedStreamError,
    joined_request,
    joining_for,
)

ADDRESS = "127.0.0.1:1"
_END = object()


class FakeCall:
    """A PublishStream as the link sees it: writes recorded, answers and end scripted."""

    def __init__(self, metadata: Any) -> None:
        self.metadata = tuple(metadata)
        self.written: list[bytes] = []
        self.items: asyncio.Queue[object] = asyncio.Queue()
        self.done = False
        self.cancelled = False

    async def write(self, request: bytes) -> None:
        if self.done:
            raise asyncio.InvalidStateError("RPC already finished.")
        self.written.append(request)

    def answer(self, response: bytes) -> None:
        self.items.put_nowait(response)

    def end(self, code: grpc.StatusCode, details: str, trailing: Any = ()) -> None:
        self.done = True
        self.items.put_nowait(
            grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
            )
        )

    def cancel(self) -> bool:
        if not self.done:
            self.done = self.cancelled = True
            self.items.put_nowait(_END)
        return True

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        for _ in range(10_000):  # bounded; each test ends its stream
            item = await self.items.get()
            if item is _END:
                raise asyncio.CancelledError
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            assert isinstance(item, bytes)
            yield item


class FakeMasters:
    """The tracker: one master at ADDRESS, whose stream calls the test reads."""

    def __init__(self) -> None:
        self.calls: list[FakeCall] = []
        self.master: Master | None = Master("n1", ADDRESS, 1)
        self.moved = asyncio.Event()

    def channel_to(self, address: str) -> FakeMasters:
        assert address == ADDRESS
        return self

    def stream_stream(self, path: str, *_: Any) -> Callable[..., FakeCall]:
        assert path == "/squall.v1.Publisher/PublishStream"

        def open_call(requests: None, metadata: Any) -> FakeCall:
            call = FakeCall(metadata)
            self.calls.append(call)
            return call

        return open_call

    async def moved_from(self, address: str) -> Master:
        await self.moved.wait()
        return Master("n2", "127.0.0.1:2", 2)


def request(publisher: str, sequence: int) -> bytes:
    return broker_pb2.PublishRequest(
        topic="t",
        publisher_id=publisher,
        events=[common_pb2.EventData(payload=b"x", sequence=sequence)],
    ).SerializeToString()


def receipt(offset: int) -> bytes:
    return broker_pb2.PublishResponse(
        receipts=[common_pb2.AckReceipt(offset=offset, master_id="n1")]
    ).SerializeToString()


def inline_error(code: str, message: str) -> bytes:
    return broker_pb2.PublishResponse(
        error=broker_pb2.PublishError(code=code, message=message)
    ).SerializeToString()


def run(
    test: Callable[[FakeMasters, SharedPublishStream], Awaitable[None]],
    inflight: int = 8,
    joining: Joining | None = None,
) -> None:
    """Runs one test against a link; without `joining`, each publish is a request of its own."""

    async def main() -> None:
        masters = FakeMasters()
        link = SharedPublishStream(
            masters,  # type: ignore[arg-type]
            ADDRESS,
            (("authorization", "Bearer x"),),
            inflight,
            "l1",
            joining,
        )
        try:
            await asyncio.wait_for(test(masters, link), 10)
        finally:
            await link.close()

    asyncio.run(main())


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def outcome(task: asyncio.Task[bytes]) -> bytes | SharedStreamError:
    try:
        return await task
    except SharedStreamError as exc:
        return exc


def test_each_caller_gets_the_response_to_its_own_request() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(5)]
        await settle()
        [call] = masters.calls
        # One stream, asking for inline errors, carrying the caller's credentials.
        assert (PUBLISH_ERRORS_KEY, INLINE_ERRORS) in call.metadata
        assert ("authorization", "Bearer x") in call.metadata
        for written in call.written:
            publisher = broker_pb2.PublishRequest.FromString(written).publisher_id
            call.answer(receipt(100 + int(publisher[1:])))
        answers = [broker_pb2.PublishResponse.FromString(await c) for c in calls]
        assert [a.receipts[0].offset for a in answers] == [100, 101, 102, 103, 104]

    run(body)


def test_a_refusal_answered_inline_goes_to_its_caller_and_the_stream_goes_on() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(3)]
        await settle()
        [call] = masters.calls
        call.answer(receipt(1))
        call.answer(inline_error("NOT_FOUND", "topic 'nope' does not exist"))
        call.answer(receipt(2))
        first, refused, third = [await outcome(c) for c in calls]
        assert isinstance(refused, SharedStreamError)
        assert (refused.code, refused.details) == ("NOT_FOUND", "topic 'nope' does not exist")
        assert not refused.collateral
        assert isinstance(first, bytes) and isinstance(third, bytes)
        later = asyncio.create_task(link.publish(request("p9", 1), 5))
        await settle()
        assert len(masters.calls) == 1  # the same stream
        call.answer(receipt(3))
        assert isinstance(await later, bytes)

    run(body)


def test_a_stream_ended_at_one_request_gives_it_the_status_and_the_rest_indeterminate() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(4)]
        await settle()
        [call] = masters.calls
        call.answer(receipt(1))
        redirect = (("squall-master-address", "127.0.0.1:2"),)
        call.end(grpc.StatusCode.FAILED_PRECONDITION, "below the dedupe window", redirect)
        answered, failed, *rest = [await outcome(c) for c in calls]
        assert isinstance(answered, bytes)
        assert isinstance(failed, SharedStreamError)
        assert failed.code == "FAILED_PRECONDITION" and failed.trailing == redirect
        for later in rest:
            # May have been started by the master: sent again (at once: the master is fine).
            assert isinstance(later, SharedStreamError)
            assert later.code == "UNAVAILABLE" and later.collateral and not later.trailing
            assert "may or may not have been applied" in later.details
        again = asyncio.create_task(link.publish(request("p1", 1), 5))
        await settle()
        assert len(masters.calls) == 2  # a fresh stream
        masters.calls[1].answer(receipt(1))
        assert isinstance(await again, bytes)

    run(body)


def test_a_broken_stream_leaves_every_unanswered_request_indeterminate() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(3)]
        await settle()
        masters.calls[0].end(grpc.StatusCode.UNAVAILABLE, "connection reset")
        results = [await outcome(c) for c in calls]
        assert all(isinstance(r, SharedStreamError) for r in results)
        assert [r.code for r in results if isinstance(r, SharedStreamError)] == ["UNAVAILABLE"] * 3
        assert not any(r.collateral for r in results if isinstance(r, SharedStreamError))

    run(body)


def test_the_master_moving_away_ends_the_stream_with_everything_unanswered_indeterminate() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(3)]
        await settle()
        masters.moved.set()  # the views name n2: a hung n1 cannot end its streams
        results = [await outcome(c) for c in calls]
        assert masters.calls[0].cancelled
        for result in results:
            assert isinstance(result, SharedStreamError) and result.code == "UNAVAILABLE"
            assert result.forwarded and not result.collateral

    run(body)


def test_a_deadline_is_indeterminate_and_the_slot_stays_taken_until_the_answer() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        late = await outcome(asyncio.create_task(link.publish(request("p0", 1), 0.05)))
        assert isinstance(late, SharedStreamError) and late.code == "DEADLINE_EXCEEDED"
        assert late.forwarded  # it was written: may or may not have been applied
        # The one slot is still the master's: the next caller waits, and is refused as
        # not forwarded (definite) when its time runs out first.
        waiting = await outcome(asyncio.create_task(link.publish(request("p1", 1), 0.05)))
        assert isinstance(waiting, SharedStreamError) and waiting.code == "DEADLINE_EXCEEDED"
        assert not waiting.forwarded
        [call] = masters.calls
        assert len(call.written) == 1
        call.answer(receipt(1))  # the late answer frees the slot (and reaches nobody)
        nxt = asyncio.create_task(link.publish(request("p2", 1), 5))
        await settle()
        assert len(call.written) == 2
        call.answer(receipt(2))
        assert broker_pb2.PublishResponse.FromString(await nxt).receipts[0].offset == 2

    run(body, inflight=1)


def test_back_pressure_holds_callers_beyond_the_inflight_bound() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(5)]
        await settle()
        [call] = masters.calls
        assert len(call.written) == 2
        call.answer(receipt(0))
        await settle()
        assert len(call.written) == 3
        for offset in range(1, 5):
            call.answer(receipt(offset))
            await settle()
        answers = [broker_pb2.PublishResponse.FromString(await c) for c in calls]
        assert [a.receipts[0].offset for a in answers] == [0, 1, 2, 3, 4]

    run(body, inflight=2)


def test_a_write_to_an_ended_stream_is_taken_back_as_indeterminate() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        first = asyncio.create_task(link.publish(request("p0", 1), 5))
        await settle()
        [call] = masters.calls
        call.done = True  # the master ended it; the reader has not seen the status yet
        second = await outcome(asyncio.create_task(link.publish(request("p1", 1), 5)))
        assert isinstance(second, SharedStreamError) and second.code == "UNAVAILABLE"
        assert call.written == [request("p0", 1)]
        call.done = False
        call.end(grpc.StatusCode.UNAVAILABLE, "gone")
        result = await outcome(first)
        assert isinstance(result, SharedStreamError) and result.code == "UNAVAILABLE"

    run(body)


def test_a_status_lost_in_transit_is_unknown_not_internal() -> None:
    # grpc/grpc#36066: a stream's status overwritten by a write in flight.
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        call_task = asyncio.create_task(link.publish(request("p0", 1), 5))
        await settle()
        masters.calls[0].end(grpc.StatusCode.INTERNAL, "Internal error from Core")
        result = await outcome(call_task)
        assert isinstance(result, SharedStreamError) and result.code == "UNKNOWN"

    run(body)


# --- joining: callers that wait share one request (PublishRequest.parts)


def parts_of(written: bytes) -> list[broker_pb2.PublishRequest]:
    return list(broker_pb2.PublishRequest.FromString(written).parts)


def joined_answer(*parts: bytes) -> bytes:
    return broker_pb2.PublishResponse(
        parts=[broker_pb2.PublishResponse.FromString(p) for p in parts]
    ).SerializeToString()


async def first_answered(
    masters: FakeMasters, link: SharedPublishStream, callers: int
) -> tuple[list[asyncio.Task[bytes]], FakeCall]:
    """`callers` publish at once (p0, p1, ...) and the master answers the first request
    (p0's, offset 0), so callers that waited go out joined: the calls and the stream."""
    calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(callers)]
    await settle()
    [call] = masters.calls
    call.answer(receipt(0))
    await settle()
    return calls, call


def test_joined_request_is_the_callers_requests_as_parts_byte_for_byte() -> None:
    requests = [request("p1", 1), request("p2", 7), request("p3", 300)]
    parsed = broker_pb2.PublishRequest.FromString(joined_request(requests))
    assert not parsed.events and not parsed.publisher_id
    assert [p.SerializeToString() for p in parsed.parts] == requests
    # A part longer than 127 bytes takes a two-byte length.
    big = broker_pb2.PublishRequest(
        topic="t",
        publisher_id="p",
        events=[common_pb2.EventData(payload=b"y" * 1000, sequence=1)],
    ).SerializeToString()
    assert [p.SerializeToString() for p in parts_of(joined_request([big, requests[0]]))] == [
        big,
        requests[0],
    ]


def test_joining_keeps_within_the_configured_limits() -> None:
    # A master refuses more parts than max_batch_events, and a message over its limit.
    small = joining_for(max_batch_events=100, max_message_bytes=1024 * 1024)
    assert (small.parts_max, small.bytes_max) == (100, 1024 * 1024 - 1024)
    default = joining_for(max_batch_events=10_000, max_message_bytes=32 * 1024 * 1024)
    assert (default.parts_max, default.bytes_max) == (1024, 4 * 1024 * 1024)


def test_callers_beyond_the_window_wait_and_go_as_one_joined_request() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(6)]
        await settle()
        [call] = masters.calls
        # The first two went at once, each as a request of its own; the rest wait.
        assert call.written == [request("p0", 1), request("p1", 1)]
        assert link.backlog() == Backlog(waiting=4, unanswered=2, in_flight=2)  # the gauges
        call.answer(receipt(100))
        await settle()
        # One answer freed room: the four waiting callers went as one request, in order.
        assert len(call.written) == 3
        assert link.backlog() == Backlog(waiting=0, unanswered=2, in_flight=5)
        assert [p.SerializeToString() for p in parts_of(call.written[2])] == [
            request(f"p{i}", 1) for i in range(2, 6)
        ]
        call.answer(receipt(101))
        refusal = inline_error("NOT_FOUND", "topic 't' does not exist")
        call.answer(joined_answer(receipt(102), refusal, receipt(104), receipt(105)))
        results = [await outcome(c) for c in calls]
        # Each caller hears its own part, byte for byte as a response of its own.
        assert results[:3] + results[4:] == [receipt(100 + i) for i in (0, 1, 2, 4, 5)]
        refused = results[3]
        assert isinstance(refused, SharedStreamError)
        assert (refused.code, refused.details) == ("NOT_FOUND", "topic 't' does not exist")
        assert (link.requests, link.joined) == (3, 4)
        assert link.backlog() == Backlog()

    run(body, joining=Joining())


def test_a_lone_caller_never_waits_for_the_joiner() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        for sequence in range(1, 4):
            call_task = asyncio.create_task(link.publish(request("p", sequence), 5))
            await settle()
            [call] = masters.calls
            assert call.written[-1] == request("p", sequence)
            call.answer(receipt(sequence))
            assert await call_task == receipt(sequence)
        assert (link.requests, link.joined) == (3, 0)

    run(body, joining=Joining())


def test_joined_requests_keep_within_their_parts_and_bytes() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(8)]
        await settle()
        [call] = masters.calls
        assert len(call.written) == 1
        call.answer(receipt(0))
        await settle()
        # Three parts at most: the six waiting go as three and three.
        assert [len(parts_of(w)) for w in call.written[1:]] == [3]
        call.answer(joined_answer(*(receipt(i) for i in (1, 2, 3))))
        await settle()
        assert [len(parts_of(w)) for w in call.written[1:]] == [3, 3]
        call.answer(joined_answer(*(receipt(i) for i in (4, 5, 6))))
        await settle()
        assert call.written[3] == request("p7", 1)  # the last one alone: not joined
        call.answer(receipt(7))
        assert [await c for c in calls] == [receipt(i) for i in range(8)]

    run(body, joining=Joining(window=1, parts_max=3))

    async def by_bytes(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls, call = await first_answered(masters, link, 4)
        # Two requests' bytes (and their parts' tags) fit, not three.
        assert len(parts_of(call.written[1])) == 2
        call.answer(joined_answer(receipt(1), receipt(2)))
        await settle()
        call.answer(receipt(3))
        assert [await c for c in calls] == [receipt(i) for i in range(4)]

    size = len(request("p0", 1)) + 6
    run(by_bytes, joining=Joining(window=1, bytes_max=2 * size + size // 2))


def test_a_waiting_caller_out_of_time_was_not_forwarded_and_frees_its_slot() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        first = asyncio.create_task(link.publish(request("p0", 1), 5))
        await settle()
        late = await outcome(asyncio.create_task(link.publish(request("p1", 1), 0.05)))
        assert isinstance(late, SharedStreamError) and late.code == "DEADLINE_EXCEEDED"
        assert not late.forwarded  # never written: nothing can have been applied
        # Its slot is free at once: with two slots, two more callers get in.
        more = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in (2, 3)]
        await settle()
        assert link.backlog() == Backlog(waiting=2, unanswered=1, in_flight=1)  # gave up: not
        [call] = masters.calls
        call.answer(receipt(0))
        await settle()
        # The caller that gave up is not in the joined request.
        assert [p.publisher_id for p in parts_of(call.written[1])] == ["p2", "p3"]
        call.answer(joined_answer(receipt(2), receipt(3)))
        assert await first == receipt(0)
        assert [await c for c in more] == [receipt(2), receipt(3)]

    run(body, inflight=3, joining=Joining(window=1))


def test_a_joined_request_refused_as_a_whole_is_sent_again_alone_and_joining_stops() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls, call = await first_answered(masters, link, 4)
        assert len(parts_of(call.written[1])) == 3
        call.answer(inline_error("INVALID_ARGUMENT", "4 parts exceed max_batch_events (2)"))
        results = [await outcome(c) for c in calls]
        assert results[0] == receipt(0)
        for refused in results[1:]:
            # Nothing of it was applied: the forwarder sends it again at once, alone.
            assert isinstance(refused, SharedStreamError) and refused.code == "UNAVAILABLE"
            assert not refused.forwarded and refused.collateral
            assert "INVALID_ARGUMENT: 4 parts exceed max_batch_events (2)" in refused.details
        assert not link.joining
        again = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(1, 4)]
        await settle()
        assert call.written[2:] == [request(f"p{i}", 1) for i in range(1, 4)]
        for offset in (1, 2, 3):
            call.answer(receipt(offset))
        assert [await c for c in again] == [receipt(i) for i in (1, 2, 3)]

    run(body, joining=Joining(window=1))


def test_a_joined_requests_whole_failure_that_is_not_definite_reaches_each_caller() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls, call = await first_answered(masters, link, 3)
        redirect = {"squall-master-address": "127.0.0.1:2"}
        call.answer(
            broker_pb2.PublishResponse(
                error=broker_pb2.PublishError(
                    code="UNAVAILABLE", message="not the master", metadata=redirect
                )
            ).SerializeToString()
        )
        _, *redirected = [await outcome(c) for c in calls]
        for result in redirected:
            assert isinstance(result, SharedStreamError) and result.code == "UNAVAILABLE"
            assert result.trailing == tuple(redirect.items()) and result.forwarded
        assert link.joining

    run(body, joining=Joining(window=1))


def test_a_stream_ended_at_a_joined_request_fails_its_callers_as_it_and_waiting_ones_unsent() -> (
    None
):
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls, call = await first_answered(masters, link, 4)
        assert len(parts_of(call.written[1])) == 3
        waiting = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in (4, 5)]
        await settle()
        call.end(grpc.StatusCode.UNKNOWN, "the master was deposed")
        results = [await outcome(c) for c in calls[1:]]
        for result in results:
            # The deposed master may have stored some: each is sent again (deduplicated).
            assert isinstance(result, SharedStreamError) and result.code == "UNKNOWN"
            assert result.forwarded
        for result in [await outcome(c) for c in waiting]:
            assert isinstance(result, SharedStreamError) and result.code == "UNAVAILABLE"
            assert not result.forwarded and "before this request was written" in result.details
        assert link.joining

    run(body, joining=Joining(window=1))


def test_an_answer_with_the_wrong_parts_is_indeterminate_and_joining_stops() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls, call = await first_answered(masters, link, 3)
        call.answer(joined_answer(receipt(1)))  # two parts sent, one answered
        _, *results = [await outcome(c) for c in calls]
        for result in results:
            assert isinstance(result, SharedStreamError) and result.code == "UNKNOWN"
            assert "may or may not have been applied" in result.details
        assert not link.joining

    run(body, joining=Joining(window=1))


def test_the_master_moving_away_fails_waiting_callers_as_not_forwarded() -> None:
    async def body(masters: FakeMasters, link: SharedPublishStream) -> None:
        calls = [asyncio.create_task(link.publish(request(f"p{i}", 1), 5)) for i in range(3)]
        await settle()
        masters.moved.set()
        written, *waiting = [await outcome(c) for c in calls]
        assert isinstance(written, SharedStreamError) and written.forwarded
        for result in waiting:
            assert isinstance(result, SharedStreamError) and not result.forwarded
        assert len(masters.calls[0].written) == 1

    run(body, joining=Joining(window=1))
