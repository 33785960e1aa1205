"""Who reads the client's shared publish stream (squall._publish_mux): a waiting caller.

No thread of its own reads the stream: one waiting caller at a time holds the reader
role, reads responses and settles whichever requests they answer, and when its own
answer is there hands the role to another waiting caller. Against a fake of the gRPC
call the mux uses (responses given by the test, one at a time), so each step is
deterministic: a lone caller reads its own answer; a reader that leaves hands the role
on; a reader whose timeout passes while it is blocked reading still gets its
`Indeterminate` (the stream is abandoned for it); a stream that ends while no one reads
it is replaced before the next publish, which does not fail for it. Requests are built
when gRPC's request thread takes them: publishes made while the message before is still
going out go as one request, and one that cannot be built fails its callers at once.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

import squall
import squall._publish_mux as publish_mux
from squall._publish_mux import PublishMux
from squall.v1 import broker_pb2, common_pb2
from tests.unit.test_client import wait_until

# A wait in the fake that only ends this way when the code under test is broken.
_STUCK_S = 30.0


class _FakeCall(grpc.RpcError):
    """A PublishStream call as `grpc` gives it: its requests consumed by a thread of its
    own, responses read with `next()` (here given by the test), cancel, end callbacks."""

    def __init__(self, requests: Iterator[broker_pb2.PublishRequest], hold: bool = False) -> None:
        self.cond = threading.Condition()
        self.requests: list[broker_pb2.PublishRequest] = []
        self.responses: collections.deque[broker_pb2.PublishResponse] = collections.deque()
        self.answered = 0
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.callbacks: list[Callable[[], None]] = []
        # The name of the thread of each `next()` call, and how many wait in one now.
        self.read_by: list[str] = []
        self.blocked_readers = 0
        self.cancelled = False
        # Clear while the request thread is still sending the last message it took (gRPC's
        # takes the next request only once the one before has gone): `hold` starts so.
        self.sent = threading.Event()
        if not hold:
            self.sent.set()
        threading.Thread(target=self._consume, args=(requests,), daemon=True).start()

    def _consume(self, requests: Iterator[broker_pb2.PublishRequest]) -> None:
        for request in requests:
            with self.cond:
                self.requests.append(request)
                self.cond.notify_all()
            assert self.sent.wait(_STUCK_S), "a test never let the message go"

    # -- the test's side --------------------------------------------------------------

    def answer(self) -> None:
        """Answers the oldest unanswered request (waits for it to arrive)."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.requests) > self.answered, _STUCK_S)
            request = self.requests[self.answered]
            self.answered += 1
            response = broker_pb2.PublishResponse(request_id=request.request_id)
            for part in request.parts or [request]:
                answer = response.parts.add() if request.parts else response
                answer.request_id = part.request_id
                for event in part.events:
                    answer.receipts.add(offset=event.sequence, lsn=event.sequence, master_id="n1")
            self.responses.append(response)
            self.cond.notify_all()

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """Ends the call as a server would, running the end callbacks here."""
        with self.cond:
            self.status = (code, details)
            callbacks, self.callbacks = self.callbacks, []
            self.cond.notify_all()
        for callback in callbacks:
            callback()

    # -- the grpc.Call side the mux uses ----------------------------------------------

    def __iter__(self) -> _FakeCall:
        return self

    def __next__(self) -> broker_pb2.PublishResponse:
        with self.cond:
            self.read_by.append(threading.current_thread().name)
            self.blocked_readers += 1
            self.cond.notify_all()
            ready = self.cond.wait_for(
                lambda: bool(self.responses) or self.status is not None, _STUCK_S
            )
            self.blocked_readers -= 1
            assert ready, "a reader waited for a response the test never gave"
            if self.responses:
                return self.responses.popleft()
            if self.status is not None and self.status[0] == grpc.StatusCode.OK:
                raise StopIteration
            raise self

    def cancel(self) -> bool:
        with self.cond:
            if self.status is not None:
                return False
            self.cancelled = True
            self.status = (grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
            callbacks, self.callbacks = self.callbacks, []
            self.responses.clear()
            self.cond.notify_all()
        # (gRPC runs them on its channel's thread, never in the cancelling caller.)
        for callback in callbacks:
            threading.Thread(target=callback, daemon=True).start()
        return True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self.cond:
            if self.status is not None:
                return False
            self.callbacks.append(callback)
            return True

    def code(self) -> grpc.StatusCode:
        return self.status[0] if self.status is not None else grpc.StatusCode.OK

    def details(self) -> str:
        return self.status[1] if self.status is not None else ""

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class _FakeStub:
    """A PublisherStub whose PublishStream calls are `_FakeCall`s, kept in order."""

    def __init__(self) -> None:
        self.calls: list[_FakeCall] = []
        self.hold_sends = False  # each call's first message stays going out until `sent`

    def PublishStream(self, requests: Iterator[Any], metadata: Any = ()) -> _FakeCall:
        call = _FakeCall(requests, hold=self.hold_sends)
        self.calls.append(call)
        return call


def _event(sequence: int) -> common_pb2.EventData:
    return common_pb2.EventData(payload=b"event %d" % sequence, sequence=sequence)


class _Caller:
    """One publish on the mux, waited for in a thread of its own."""

    def __init__(
        self, mux: PublishMux, name: str, sequence: int, timeout_s: float, *, wait: bool = True
    ) -> None:
        self.name = name
        self.entry = mux.submit("t", name, _event(sequence))
        self.outcome: squall.Receipt | BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(mux, timeout_s), name=name, daemon=True
        )
        if wait:
            self.thread.start()

    def _run(self, mux: PublishMux, timeout_s: float) -> None:
        try:
            self.outcome = mux.result(self.entry, timeout_s)
        except BaseException as exc:  # the test looks at it
            self.outcome = exc

    def join(self) -> squall.Receipt | BaseException | None:
        self.thread.join(_STUCK_S)
        assert not self.thread.is_alive(), f"{self.name} is still waiting"
        return self.outcome


@pytest.fixture
def stub() -> _FakeStub:
    return _FakeStub()


def test_a_lone_caller_reads_its_own_answer(stub: _FakeStub) -> None:
    """No other thread reads the stream: the caller's own thread reads its answer."""
    mux = PublishMux(stub)  # type: ignore[arg-type]
    caller = _Caller(mux, "lone", 1, timeout_s=_STUCK_S)
    call = stub.calls[0]
    wait_until(lambda: call.blocked_readers == 1)
    call.answer()
    receipt = caller.join()
    assert isinstance(receipt, squall.Receipt) and receipt.offset == 1
    assert call.read_by == ["lone"]
    assert not [t for t in threading.enumerate() if t.name == "squall-publish-shared"]
    mux.close()


def test_a_reader_that_leaves_hands_the_role_to_a_waiting_caller(stub: _FakeStub) -> None:
    """The first caller reads its answer and leaves; the second, waiting meanwhile with
    its request out, is handed the reader role and reads its own answer (it is not left
    waiting for a reader until its timeout)."""
    mux = PublishMux(stub)  # type: ignore[arg-type]
    first = _Caller(mux, "first", 1, timeout_s=_STUCK_S)
    call = stub.calls[0]
    wait_until(lambda: call.blocked_readers == 1)
    second = _Caller(mux, "second", 1, timeout_s=5.0)
    # Its request out too: built after the first reader left, it would wake its caller
    # itself (not a hand-on).
    wait_until(lambda: second.entry.future.parked and len(call.requests) == 2)
    call.answer()
    assert isinstance(first.join(), squall.Receipt)
    wait_until(lambda: call.blocked_readers == 1)
    call.answer()
    assert isinstance(second.join(), squall.Receipt)
    assert call.read_by == ["first", "second"]
    assert mux.reads_handed_on == 1
    mux.close()


def test_a_reader_settles_the_requests_it_reads_for_other_callers(stub: _FakeStub) -> None:
    """The reader settles every request it reads, not only its own: the caller whose
    request went first but who started waiting after the reader returns without ever
    reading."""
    mux = PublishMux(stub)  # type: ignore[arg-type]
    early = _Caller(mux, "early", 1, timeout_s=_STUCK_S, wait=False)
    call = stub.calls[0]
    wait_until(lambda: len(call.requests) == 1)
    reader = _Caller(mux, "reader", 1, timeout_s=_STUCK_S)
    wait_until(lambda: call.blocked_readers == 1)
    early.thread.start()
    wait_until(lambda: early.entry.future.parked)
    call.answer()
    receipt = early.join()
    assert isinstance(receipt, squall.Receipt) and receipt.offset == 1
    call.answer()
    assert isinstance(reader.join(), squall.Receipt)
    assert call.read_by == ["reader", "reader"]
    assert mux.reads_handed_on == 0
    mux.close()


def test_a_reader_whose_timeout_passes_abandons_the_stream(stub: _FakeStub) -> None:
    """Blocked reading a stream that never answers, the caller cannot time out by
    itself: at its deadline the stream is abandoned for it, as a waiting caller's
    timeout abandons it, and the caller gets `Indeterminate` (the event may be stored)."""
    mux = PublishMux(stub)  # type: ignore[arg-type]
    caller = _Caller(mux, "reader", 1, timeout_s=0.2)
    call = stub.calls[0]
    error = caller.join()
    assert isinstance(error, squall.Indeterminate), error
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no receipt within 0.2 s" in error.details
    assert call.cancelled and call.read_by and set(call.read_by) == {"reader"}
    # The next publish goes on a fresh stream.
    again = _Caller(mux, "again", 2, timeout_s=_STUCK_S)
    wait_until(lambda: len(stub.calls) == 2 and stub.calls[1].blocked_readers == 1)
    stub.calls[1].answer()
    assert isinstance(again.join(), squall.Receipt)
    mux.close()


def test_a_stream_that_ends_while_no_one_reads_it_is_replaced_at_once(stub: _FakeStub) -> None:
    """With nothing unanswered, no caller reads the stream; its end is still noticed,
    so the next publish goes on a fresh stream instead of failing on the ended one."""
    mux = PublishMux(stub)  # type: ignore[arg-type]
    first = _Caller(mux, "first", 1, timeout_s=_STUCK_S)
    call = stub.calls[0]
    call.answer()
    assert isinstance(first.join(), squall.Receipt)
    call.end(grpc.StatusCode.UNAVAILABLE, "the gateway went away")
    second = _Caller(mux, "second", 2, timeout_s=_STUCK_S)
    assert len(stub.calls) == 2
    stub.calls[1].answer()
    assert isinstance(second.join(), squall.Receipt)
    assert call.requests[-1].events[0].sequence == 1
    mux.close()


def test_a_caller_waiting_for_a_slot_fails_as_not_sent_when_the_stream_ends(
    stub: _FakeStub,
) -> None:
    """A window of one: the second caller waits to be sent; the first's reader reads the
    stream's end, which tells both (the sent one indeterminate, the waiting one not
    sent, so its retry is safe)."""
    mux = PublishMux(stub, inflight_max=1)  # type: ignore[arg-type]
    first = _Caller(mux, "first", 1, timeout_s=_STUCK_S)
    call = stub.calls[0]
    # gRPC's request thread (the fake's) has taken the first request off the stream.
    wait_until(lambda: call.blocked_readers == 1 and len(call.requests) == 1)
    second = _Caller(mux, "second", 1, timeout_s=_STUCK_S)
    wait_until(lambda: second.entry.future.parked)
    call.end(grpc.StatusCode.UNAVAILABLE, "the gateway went away")
    assert isinstance(first.join(), squall.Indeterminate)
    error = second.join()
    assert isinstance(error, squall.Unavailable) and not error.maybe_stored, error
    assert len(call.requests) == 1
    mux.close()


def test_publishes_made_while_the_last_message_is_still_going_out_go_as_one_request(
    stub: _FakeStub,
) -> None:
    """A request is built when gRPC's request thread is ready to send it, not when a slot
    frees: the callers that publish while the message before is still going out (as the
    threads one answer wakes do, one after the other) all go in the next request, not the
    first of them alone and the rest in the one after."""
    mux = PublishMux(stub)  # type: ignore[arg-type]
    stub.hold_sends = True
    first = _Caller(mux, "first", 1, timeout_s=_STUCK_S)
    call = stub.calls[0]
    wait_until(lambda: len(call.requests) == 1)
    others = [_Caller(mux, f"p{i}", 1, timeout_s=_STUCK_S) for i in range(3)]
    for caller in others:
        wait_until(lambda caller=caller: caller.entry.future.parked)
    call.sent.set()
    wait_until(lambda: len(call.requests) == 2)
    joined = call.requests[1]
    assert [part.publisher_id for part in joined.parts] == ["p0", "p1", "p2"]
    call.answer()
    call.answer()
    assert isinstance(first.join(), squall.Receipt)
    for caller in others:
        receipt = caller.join()
        assert isinstance(receipt, squall.Receipt) and receipt.offset == 1, receipt
    assert len(call.requests) == 2
    mux.close()


def test_a_request_that_cannot_be_built_fails_its_callers_and_the_stream_goes_on(
    stub: _FakeStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests are built on gRPC's request thread: a failure there (a client bug) reaches
    the callers whose events it held, as not sent, instead of leaving them waiting until
    their timeout; the next publish goes out on the same stream."""
    build = publish_mux.build_request
    failures = [RuntimeError("a bug")]

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return build(*args, **kwargs)

    monkeypatch.setattr(publish_mux, "build_request", fails_once)
    mux = PublishMux(stub)  # type: ignore[arg-type]
    error = _Caller(mux, "first", 1, timeout_s=_STUCK_S).join()
    assert isinstance(error, squall.SquallError) and not error.maybe_stored, error
    assert "failed building the request" in error.details and "a bug" in error.details
    second = _Caller(mux, "second", 1, timeout_s=_STUCK_S)
    stub.calls[0].answer()
    assert isinstance(second.join(), squall.Receipt)
    assert len(stub.calls) == 1
    mux.close()
