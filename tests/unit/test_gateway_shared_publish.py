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
from squall_server.gateway.shared_publish import SharedPublishStream, SharedStreamError

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
    test: Callable[[FakeMasters, SharedPublishStream], Awaitable[None]], inflight: int = 8
) -> None:
    async def main() -> None:
        masters = FakeMasters()
        link = SharedPublishStream(
            masters, ADDRESS, (("authorization", "Bearer x"),), inflight, "l1"
        )  # type: ignore[arg-type]
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
