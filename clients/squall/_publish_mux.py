"""Publish streams a client shares between the one-at-a-time publishes of its publishers:
one through the gateway, and one to each replica address its publisher proxies are bound to.

Many threads each publishing one event at a time with a `Publisher` of their own used to
cost a stream per publisher: one request per event on every hop, with a gRPC message, a
thread hand-off and a stream read each (bench/README.md, issue 16). Here every gateway
publisher of one `Client` sends its lone `publish()` calls on one `PublishStream`. While
the window has a free slot, a call asks gRPC's request thread for a request, and that
thread builds it when it takes it (`_requests`) from every event waiting then: a lone
publish goes out as soon as the thread is free (it never waits for a timer or for
others), and the calls made meanwhile, such as those of the threads one answer woke, go
with it; calls that arrive while the window is full wait, and go together when a slot
frees. That request joins the events per publisher (one part per publisher id and topic,
its events in call order) and, when more than one publisher is in it, carries the parts
in `PublishRequest.parts`:
the master publishes each part as a request of its own (its publisher id, sequences and
session token; deduplicated as always) and answers each part apart, so one part's refusal
fails that part's callers only.

Rules kept:

* Order per publisher: a publisher hands its events over under its own lock, in sequence
  order, and they stay in that order here, on the wire and in the master.
* Errors stay with their caller: the stream asks for failed requests to be answered
  inline (`squall-publish-errors: inline`), so a refusal does not end the stream; a
  refused part of several events (or a whole joined request refused, e.g. by a server
  that knows no parts) is not blamed on all of them: each event is sent again alone
  (`JoinRefused`, nothing was stored), and only the culprit's caller sees the refusal.
* Retries are the caller's (`Publisher`, under its retry policy) with the same publisher
  id and sequence, so an event whose outcome a broken stream left open is stored once.
  A part answered as by a master that is no longer one (a redirect, a deposition) also
  abandons the stream, so the retries reach the gateway's current master on a fresh one.
* The joining itself (which events go together, the request, splitting the answers) is
  `squall._publish_join`'s, shared with the asyncio client's `squall.aio._publish_mux`.

Who reads the stream (issue 16, item 2): no thread of its own, which cost a lone publish
a wake-up of that thread and one of the caller (bench/client_overhead.py). One waiting
caller at a time holds a stream's reader role (leader/followers): it reads the next
response, settles whichever requests it answers (waking their callers), and once its own
answer is there gives the role up, signalling a waiting caller with a request still
unanswered on the stream, which takes it (`_hand_role_on`). A lone caller thus reads its
own answer. Only callers with a request on the stream read it (and, once it is
abandoned, those waiting for a slot on it, since its end then comes at once), so a
reader blocked in gRPC's read is always waiting for something its own timeout covers:

* a reader cannot time itself out while blocked, so one thread per stream
  (`_watch_deadlines`, asleep until the current reader's deadline; woken only when a
  reader with an earlier one takes the role) abandons the stream at that deadline, as
  that caller would; the read then ends at once and the caller gets `Indeterminate`;
* a waiting caller times out by itself, as before: abandoning the stream if its request
  was sent (the reader then reads the end), failing alone if it still waited for a slot;
* a caller interrupted while waiting abandons its attempt the same way, so others do not
  wait behind a request no one reads for;
* a stream that ends while nothing is unanswered (no one reads it) is ended from gRPC's
  end-of-call callback (`_call_ended`), so the next publish opens a fresh stream rather
  than learning of the end by a failed attempt; with requests unanswered, that callback
  signals a waiting caller to read the end if no one holds the role.

Publisher proxies (`replicated=True/False`) share too, one stream per replica address
(`ProxyMuxes`, a `PublishMux` per address made on demand and closed with the client), so
64 proxies bound to the master are one stream to it whose concurrent lone publishes join
as the gateway publishers' do. Where each attempt goes stays the proxy's own: its binding
(`squall._proxy.ProxyBinding`) names the replica for every attempt, the attempt goes on
that address's stream, and how it ended is told to that binding alone, as a stream of the
proxy's own would tell it (`_Entry.ended`, `ProxyBinding.stream_failed`):

* a stream's end (the status and trailing metadata, or the reason the client abandoned
  it) reaches every caller with an event on it or waiting for it, so each of their
  proxies moves as its own stream's end would move it (to the next endpoint on an
  indeterminate end, to the master a redirect names); a `replicated=False` proxy is lost
  instead and raises `PublisherLost`; a proxy with nothing on the stream stays bound;
* a request or part a slave refuses is answered inline (`UNAVAILABLE` with
  `squall-master-address` in `PublishError.metadata`, services/replica/server.py): its
  callers' proxies follow the redirect, and the stream is abandoned naming that master
  (`_MuxStream.moved_to`), so the proxies of the other requests on it follow it too;
* a replica stream has the stall watchdog a proxy's own stream has (`Publisher._watch`):
  a receipt late by RECEIPT_STALL_AFTER_S makes it ask the gateway who the master is
  (with the check of the proxy that opened the stream), and it abandons the stream for
  the master named;
* the first answer a proxy gets from a stream on another replica is its move
  (`on_rebind`, `Receipt.rebound`), reported by the caller before it returns the receipt;
  its retries (same id and sequence) go on the stream of the replica its binding names
  then, opened with the binding's request metadata (`squall-unreachable`) if new.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from squall._errors import Indeterminate, SquallError, error_for, rpc_status
from squall._proxy import Endpoint
from squall._publish_join import (
    INLINE_ERRORS_METADATA,
    JOIN_BYTES_MAX,
    JOIN_EVENTS_MAX,
    SHARED_INFLIGHT_MAX,
    Entry,
    JoinRefused,
    Sent,
    Trailing,
    answers,
    build_request,
    entry_key,
    fail_ended,
    inline_error,
    mismatch_error,
    new_entry,
    plain,
    refuses_parts,
    request_key,
    settle,
    take_next,
)
from squall._publish_rules import (
    NotSent,
    abandon_stream,
    moved_trailing,
    new_session_token,
    not_sent_error,
    watch_stalls,
)
from squall._types import Receipt
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall.wire import stages as _stages

__all__ = [
    "INLINE_ERRORS_METADATA",
    "JOIN_BYTES_MAX",
    "JOIN_EVENTS_MAX",
    "SHARED_INFLIGHT_MAX",
    "JoinRefused",
    "ProxyMuxes",
    "PublishMux",
]

log = logging.getLogger("squall")

# Asks the gateway which replica is master ("" if it cannot say within the timeout given).
CheckMaster = Callable[[float], str]


class Answer:
    """One attempt's outcome, and its caller's wake-up: set once (a receipt or an error),
    and signalled as well when its caller may take its stream's reader role.

    Lighter than a `concurrent.futures.Future` (no condition, no callbacks): the gate is a
    lock held while nothing is signalled, so waking the caller is one release and a
    signal given before the caller waits is not lost (signals do not add up).
    """

    __slots__ = ("_done", "_error", "_gate", "_receipt", "parked")

    def __init__(self) -> None:
        self._done = False
        self._receipt: Receipt | None = None
        self._error: BaseException | None = None
        self._gate = threading.Lock()
        self._gate.acquire()
        # True while its caller waits for a signal (read and set under the mux's lock): a
        # reader leaving its role hands it to such a caller.
        self.parked = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Receipt, /) -> None:
        if not self._done:
            self._receipt = result
            self._done = True
            self.signal()

    def set_exception(self, exception: BaseException, /) -> None:
        if not self._done:
            self._error = exception
            self._done = True
            self.signal()

    def result(self) -> Receipt:
        """The receipt, or raises the error (only once `done()`)."""
        if self._error is not None:
            raise self._error
        assert self._receipt is not None
        return self._receipt

    def signal(self) -> None:
        """Wakes the caller (or its next wait: a signal is kept until it is taken)."""
        try:
            self._gate.release()
        except RuntimeError:
            pass  # already signalled

    def wait(self, timeout_s: float) -> None:
        """Until signalled or the timeout; the caller checks what changed."""
        self._gate.acquire(timeout=max(timeout_s, 0.0))


_Entry = Entry[Answer]
_Sent = Sent[Answer]


class _MuxStream:
    """One open PublishStream: its request queue, its unanswered requests, and who reads it
    (one waiting caller at a time: the reader role)."""

    def __init__(
        self, generation: int, lock: threading.Lock, check_master: CheckMaster | None = None
    ) -> None:
        self.generation = generation
        self.session_token = new_session_token("shared")
        # What gRPC's request thread takes: a ticket (True) to build the next request from
        # the events waiting when it takes it, or None to end the stream's requests.
        self.requests: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self.ticketed = False  # whether a ticket is queued, not yet taken
        self.pending: collections.deque[_Sent] = collections.deque()
        self.dead = False
        self.abort_error: SquallError | None = None
        # Set when abandoned because another replica is master now (a slave's redirect
        # answered inline, or the stall watchdog): its callers' proxies follow it.
        self.moved_to = ""
        self.call: Any = None
        # A replica stream's stall check (the opening proxy's), and what wakes its
        # watchdog: a request sent while none was pending, or the stream's end.
        self.check_master = check_master
        self.woken = threading.Event()
        self.watched = False  # whether a stall watchdog runs (then `woken` is used)
        # The caller holding the reader role (None: no one reads now), and when it gives
        # up waiting: the deadline watch (`_watch_deadlines`) abandons the stream then,
        # as that caller would if it were not blocked reading.
        self.reader: _Entry | None = None
        self.reader_deadline = 0.0
        self.reader_timeout_s = 0.0
        # What wakes the deadline watch (on the mux's lock), and when it wakes anyway.
        self.deadline_cond = threading.Condition(lock)
        self.watch_until = _NEVER


_NEVER = float("inf")


class PublishMux:
    """A client's shared publish stream for one-at-a-time publishes (see the module doc)."""

    def __init__(
        self,
        stub: broker_pb2_grpc.PublisherStub,
        *,
        inflight_max: int = SHARED_INFLIGHT_MAX,
        endpoint: Endpoint | None = None,
    ) -> None:
        self._stub = stub
        # The replica this mux's streams go to (None: through the gateway).
        self.endpoint = endpoint
        self._inflight_max = inflight_max
        self._lock = threading.Lock()
        self._stream: _MuxStream | None = None
        self._waiting: collections.deque[_Entry] = collections.deque()
        self._next_request_id = 1
        self._generation = 0
        # Off once a server refused a joined request whole (it knows no parts).
        self._joins = True
        self._closed = False
        # Requests sent with parts of more than one publisher, and streams opened.
        self.joined_requests = 0
        self.streams_opened = 0
        # Times a caller took a stream's reader role, and times one was handed on.
        self.reads_taken = 0
        self.reads_handed_on = 0

    def submit(
        self,
        topic: str,
        publisher_id: str,
        event: common_pb2.EventData,
        *,
        alone: bool = False,
        metadata: Trailing = (),
        check_master: CheckMaster | None = None,
    ) -> _Entry:
        """Queues one event; `result` waits for the receipt or the error of this attempt.

        `alone` keeps it out of joined requests (after `JoinRefused`). The caller holds its
        publisher's lock, so one publisher's events arrive here in sequence order. A
        publisher proxy gives its binding's request `metadata` and stall check, used if
        this call opens the stream.
        """
        entry = new_entry(topic, publisher_id, event, Answer(), alone, self)
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            stream = self._live_stream(metadata, check_master)
            self._waiting.append(entry)
            if _stages.ENABLED:
                _stages.mark("c.queued", entry_key(entry))
            self._pump(stream)
        return entry

    def result(self, entry: _Entry, timeout_s: float) -> Receipt:
        """Waits for one attempt's receipt, reading the stream itself when no one else
        does; past the timeout the stream it went on is abandoned (every request on it
        becomes indeterminate, and is retried by its caller) and, if even that outcome
        does not come, `Indeterminate`."""
        answer = entry.future
        try:
            answered = self._wait(entry, timeout_s)
            if not answered:
                self._give_up(
                    entry, grpc.StatusCode.DEADLINE_EXCEEDED, f"no receipt within {timeout_s} s"
                )
                answered = self._wait(entry, timeout_s)
        except BaseException:
            # An interrupted caller abandons its attempt as a timed-out one does, so the
            # others on its stream do not wait behind a request no one reads for.
            if not answer.done():
                self._give_up(entry, grpc.StatusCode.CANCELLED, "the caller stopped waiting")
            raise
        if not answered:
            raise Indeterminate(
                f"no receipt within {timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            )
        return answer.result()

    def close(self) -> None:
        """Half-closes the stream; events still waiting fail as not sent."""
        with self._lock:
            self._closed = True
            stream = self._stream
            self._stream = None
            waiting = list(self._waiting)
            self._waiting.clear()
            if stream is not None:
                stream.deadline_cond.notify()
        for entry in waiting:
            entry.future.set_exception(not_sent_error("the client was closed"))
        if stream is not None:
            stream.requests.put(None)

    # -- waiting and reading ------------------------------------------------------------

    def _wait(self, entry: _Entry, timeout_s: float) -> bool:
        """Waits up to `timeout_s` for the entry's answer; True once it is there.

        Leader/followers: a waiting caller whose stream no one reads takes the reader role
        and reads (`_read`) until its own answer is there, settling whatever it reads; the
        others wait for their answer or for the role to be handed to them. So a lone
        caller reads its own answer, with no other thread in between.
        """
        answer = entry.future
        deadline = time.monotonic() + timeout_s
        # Bounded by the deadline: each turn reads a response, or waits for a signal or
        # the deadline.
        while True:
            with self._lock:
                if answer.done():
                    answer.parked = False
                    return True
                stream = self._stream_to_read(entry)
                if stream is not None:
                    answer.parked = False
                    self._take_role(stream, entry, deadline, timeout_s)
                else:
                    answer.parked = True
            if stream is not None:
                self._read(stream, entry)
                continue
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                with self._lock:
                    answer.parked = False
                    return answer.done()
            answer.wait(left_s)

    def _stream_to_read(self, entry: _Entry) -> _MuxStream | None:
        """The stream this caller reads now, if its reader role is free (lock held): the
        one its request went on; while still waiting for a slot, the one it waits on once
        abandoned (the end is read at once; a live one's reader is a caller with a request
        on it, whose timeout may abandon it)."""
        stream: _MuxStream | None = entry.stream
        if stream is None:
            stream = self._stream
            if stream is None or stream.abort_error is None:
                return None
        if stream.reader is not None or stream.dead:
            return None
        return stream

    def _take_role(
        self, stream: _MuxStream, entry: _Entry, deadline: float, timeout_s: float
    ) -> None:
        stream.reader = entry
        stream.reader_deadline = deadline
        stream.reader_timeout_s = timeout_s
        self.reads_taken += 1
        if deadline < stream.watch_until:
            stream.deadline_cond.notify()

    def _leave_role(self, stream: _MuxStream) -> None:
        """Gives the reader role up (lock held) and hands it on if someone needs it."""
        stream.reader = None
        if self._closed:
            stream.deadline_cond.notify()
        self._hand_role_on(stream)

    def _hand_role_on(self, stream: _MuxStream, *, handed: bool = True) -> bool:
        """Signals a waiting caller who needs the stream read, while no one reads it (lock
        held): one with a request on it, or once it is abandoned, one waiting to be sent
        on it. False if there is none. `handed`: counted in `reads_handed_on` (not when a
        request just built wakes one of its callers)."""
        if stream.dead or stream.reader is not None:
            return False
        for sent in stream.pending:
            for group in sent.groups:
                for other in group:
                    if other.future.parked and not other.future.done():
                        self._hand_on(other, handed)
                        return True
        if stream.abort_error is not None and self._stream is stream:
            for other in self._waiting:
                if other.future.parked and not other.future.done():
                    self._hand_on(other, handed)
                    return True
        return False

    def _hand_on(self, entry: _Entry, handed: bool) -> None:
        entry.future.parked = False
        self.reads_handed_on += handed
        entry.future.signal()

    def _read(self, stream: _MuxStream, entry: _Entry) -> None:
        """Holding the reader role: reads responses, handing each one's receipts (or
        errors) to their callers in request order, until this caller's answer is there
        (read on to the end if the stream was abandoned: that comes at once) or the
        stream ends; then leaves the role."""
        answer = entry.future
        try:
            while not answer.done() or (stream.abort_error is not None and not stream.dead):
                if not self._read_one(stream):
                    break
        finally:
            with self._lock:
                self._leave_role(stream)

    def _read_one(self, stream: _MuxStream) -> bool:
        """Reads one response and settles it; False once the stream has ended (and its
        end was told to every caller on it)."""
        sent: _Sent | None = None
        try:
            try:
                response = next(stream.call)
            except StopIteration:
                self._fail(stream, grpc.StatusCode.UNKNOWN, _CLOSED_UNANSWERED)
                return False
            except grpc.RpcError as err:
                code, details = rpc_status(err)
                trailing_fn = getattr(err, "trailing_metadata", None)
                trailing = plain(trailing_fn()) if callable(trailing_fn) else None
                self._fail(stream, code, details, trailing)
                return False
            with self._lock:
                sent = stream.pending.popleft() if stream.pending else None
                if sent is None or not answers(sent, response):
                    if sent is not None:
                        stream.pending.appendleft(sent)
                        sent = None
                    stream.abort_error = mismatch_error(response)
                    stream.call.cancel()
                else:
                    self._pump(stream)
            if sent is None:
                self._fail(stream, grpc.StatusCode.UNKNOWN, _CLOSED_UNANSWERED)
                return False
            if _stages.ENABLED:
                _stages.mark("c.resp", entry_key(sent.groups[0][0]))
            gone = self._settle(sent, response)
            if gone is not None:
                with self._lock:
                    if gone and not stream.dead and stream.abort_error is None:
                        # A slave's redirect: the other callers' proxies follow it too.
                        stream.moved_to = gone
                    self._abort(
                        stream,
                        grpc.StatusCode.UNAVAILABLE,
                        "the master answered a publish as no longer master",
                    )
            return True
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come: the
            # stream is abandoned and ended at once (the request being settled with it).
            log.exception("squall: reading the shared publish stream failed")
            with self._lock:
                self._abort(
                    stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
                )
                if sent is not None:
                    stream.pending.appendleft(sent)
            self._fail(stream, grpc.StatusCode.UNKNOWN, _CLOSED_UNANSWERED)
            return False

    def _give_up(self, entry: _Entry, code: grpc.StatusCode, details: str) -> None:
        """A caller stops waiting: an event never sent (the window stayed full) fails
        with nothing to abandon; a sent one abandons its stream."""
        with self._lock:
            stream = entry.stream
            if stream is None and entry in self._waiting:
                self._waiting.remove(entry)
                entry.future.set_exception(error_for(code, "publish window stayed full"))
            elif stream is not None:
                self._abort(stream, code, details)

    def _watch_deadlines(self, stream: _MuxStream) -> None:
        """The reader's timeout (its own thread, one per stream): a caller blocked reading
        cannot time out itself, so once the deadline of whoever holds the reader role
        passes, this abandons the stream as that caller would, which ends its read at
        once. Wakes when a reader with an earlier deadline than it waits for takes the
        role, at the deadline it waits for, and at the stream's end: not per publish."""
        with self._lock:
            # Bounded: each turn waits until a deadline or a change; ends with the stream.
            while not stream.dead and not (
                self._closed and stream.reader is None and not stream.pending
            ):
                now = time.monotonic()
                if stream.reader is None or stream.abort_error is not None:
                    # Nothing to time (an abandoned stream's reader returns at once).
                    stream.watch_until = _NEVER
                    stream.deadline_cond.wait()
                elif stream.reader_deadline <= now:
                    self._abort(
                        stream,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no receipt within {stream.reader_timeout_s} s",
                    )
                else:
                    stream.watch_until = stream.reader_deadline
                    stream.deadline_cond.wait(stream.reader_deadline - now)
            stream.watch_until = _NEVER

    def _call_ended(self, stream: _MuxStream) -> None:
        """The stream's call ended (gRPC's callback, on its channel's thread). While no
        one reads it: with nothing unanswered, its end is told here (so the next publish
        opens a fresh stream instead of learning it by a failed attempt); otherwise a
        waiting caller is signalled to read the end."""
        with self._lock:
            if stream.reader is not None or stream.pending or stream.dead:
                self._hand_role_on(stream)
                return
        call = stream.call
        code, details = rpc_status(call)
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNKNOWN, _CLOSED_UNANSWERED
        self._fail(stream, code, details, plain(call.trailing_metadata()), if_idle=True)

    # -- sending (lock held) ----------------------------------------------------------

    def _live_stream(self, metadata: Trailing, check_master: CheckMaster | None) -> _MuxStream:
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        self._generation += 1
        stream = _MuxStream(self._generation, self._lock, check_master)
        stream.call = self._stub.PublishStream(
            self._requests(stream), metadata=INLINE_ERRORS_METADATA + metadata
        )
        stream.call.add_callback(functools.partial(self._call_ended, stream))
        self._stream = stream
        self.streams_opened += 1
        threading.Thread(
            target=self._watch_deadlines,
            args=(stream,),
            name="squall-publish-deadlines",
            daemon=True,
        ).start()
        if self.endpoint is not None and check_master is not None:
            stream.watched = True
            threading.Thread(
                target=self._watch, args=(stream,), name="squall-publish-watch-shared", daemon=True
            ).start()
        return stream

    def _pump(self, stream: _MuxStream) -> None:
        """Asks gRPC's request thread for a request when events wait and the window has
        room: one ticket at a time, built when that thread takes it (`_requests`), so the
        events that gather until then go out with it."""
        if (
            self._waiting
            and not stream.ticketed
            and len(stream.pending) < self._inflight_max
            and not stream.dead
        ):
            stream.ticketed = True
            stream.requests.put(True)

    def _requests(self, stream: _MuxStream) -> Iterator[broker_pb2.PublishRequest]:
        """The stream's requests, taken by gRPC's request thread: each built from the
        events waiting when the thread takes its ticket, which is once the message before
        has gone, not when the ticket was queued. The threads one answer woke publish
        again one after the other, so built at once, the first of them went out nearly
        alone and the others waited for the next free slot (the asyncio client sends at
        the end of the loop's turn for the same reason)."""
        get = stream.requests.get
        while get() is not None:
            # Gives the GIL to the threads one answer just woke before building: each
            # publishes again and parks at once, so more of them go in this request (64
            # threads on one publisher: 28.5 events per request instead of 23).
            time.sleep(0)
            with self._lock:
                stream.ticketed = False
                if stream.dead or stream.abort_error is not None or self._stream is not stream:
                    continue
                if not self._waiting:
                    continue
                entries = take_next(self._waiting, self._joins)
                try:
                    request = self._send(stream, entries)
                except Exception as exc:
                    # (On gRPC's thread: its callers hear it, nothing went out.)
                    log.exception("squall: building a shared publish request failed")
                    error = NotSent(
                        f"not sent: the client failed building the request ({exc!r})",
                        grpc.StatusCode.INTERNAL,
                    )
                    for entry in entries:
                        entry.future.set_exception(error)
                    self._pump(stream)
                    continue
                self._pump(stream)
                # Its callers wait parked while no one reads: one of them reads its answer.
                self._hand_role_on(stream, handed=False)
            if _stages.ENABLED:
                _stages.mark("c.wire", request_key(request))
            yield request

    def _send(self, stream: _MuxStream, entries: list[_Entry]) -> broker_pb2.PublishRequest:
        request_id = self._next_request_id
        self._next_request_id += 1
        # (Only a stall watchdog reads when a request went out, and needs waking for it.)
        watched = stream.watched
        request, sent = build_request(
            entries, stream.session_token, request_id, stream, time.monotonic() if watched else 0.0
        )
        self.joined_requests += sent.joined
        if watched and not stream.pending:
            stream.woken.set()
        stream.pending.append(sent)
        return request

    def _abort(self, stream: _MuxStream, code: grpc.StatusCode, details: str) -> None:
        abandon_stream(stream, code, details)

    def _watch(self, stream: _MuxStream) -> None:
        """A replica stream's stall watchdog (its own thread), as a proxy's own stream has
        (`Publisher._watch`): once the oldest unanswered request is RECEIPT_STALL_AFTER_S
        old, asks every RECEIPT_STALL_CHECK_S who the master is and abandons the stream as
        soon as the gateway names another replica; its callers' proxies then move there."""
        endpoint, check = self.endpoint, stream.check_master
        if endpoint is not None and check is not None:
            watch_stalls(stream, self._lock, endpoint, check, "shared", self._abort)

    # -- answers ------------------------------------------------------------------------

    def _settle(self, sent: _Sent, response: broker_pb2.PublishResponse) -> str | None:
        """Resolves the futures of one answered request. Not None if the master is gone:
        the master a slave's redirect names, or ""."""
        if refuses_parts(sent, response):
            # A server without parts: join no more, each event goes again alone.
            with self._lock:
                if self._joins:
                    log.info(
                        "squall: the server refused a joined publish (%s)",
                        inline_error(response.error),
                    )
                self._joins = False
        return settle(sent, response)

    def _fail(
        self,
        stream: _MuxStream,
        code: grpc.StatusCode,
        details: str,
        trailing: Trailing | None = None,
        *,
        if_idle: bool = False,
    ) -> None:
        """Ends a stream: its oldest request gets the status, the others are indeterminate,
        and events still waiting fail as not sent (their callers send them again).
        Each of them keeps how the stream ended (`Entry.ended`). `if_idle`: only if nothing
        is unanswered and no one reads it (checked with the ending, under the lock)."""
        with self._lock:
            if stream.dead:
                return
            if if_idle and (stream.reader is not None or stream.pending):
                return
            stream.dead = True
            stream.woken.set()
            stream.deadline_cond.notify()
            pending = list(stream.pending)
            stream.pending.clear()
            waiting: list[_Entry] = []
            if self._stream is stream or self._stream is None:
                self._stream = None
                waiting = list(self._waiting)
                self._waiting.clear()
        stream.requests.put(None)  # ends gRPC's request-consumer thread
        end_code = stream.abort_error.code if stream.abort_error is not None else code
        ended = (end_code, moved_trailing(stream.moved_to) if stream.moved_to else trailing)
        fail_ended(pending, code, details, stream.abort_error, ended)
        unsent = not_sent_error(details)
        for entry in waiting:
            entry.ended = ended
            entry.future.set_exception(unsent)


_CLOSED_UNANSWERED = "the server closed the publish stream without answering"


class ProxyMuxes:
    """A client's shared streams to replicas, one `PublishMux` per replica address, made
    when a publisher proxy bound there first publishes alone, closed with the client."""

    def __init__(self, inflight_max: int = SHARED_INFLIGHT_MAX) -> None:
        self._inflight_max = inflight_max
        self._lock = threading.Lock()
        self._muxes: dict[str, tuple[Any, PublishMux]] = {}
        self._closed = False

    def get(self, endpoint: Endpoint, make_channel: Callable[[str], Any]) -> PublishMux:
        """The shared stream to `endpoint`'s address; `make_channel(address)` opens its
        channel the first time (the client owns it from then on)."""
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            made = self._muxes.get(endpoint.address)
            if made is None:
                channel = make_channel(endpoint.address)
                mux = PublishMux(
                    broker_pb2_grpc.PublisherStub(channel),
                    inflight_max=self._inflight_max,
                    endpoint=endpoint,
                )
                made = self._muxes[endpoint.address] = (channel, mux)
        return made[1]

    def addresses(self) -> list[str]:
        """The replica addresses with a shared stream (made so far)."""
        with self._lock:
            return sorted(self._muxes)

    def close(self) -> None:
        """Closes every shared stream and its channel."""
        with self._lock:
            self._closed = True
            made = list(self._muxes.values())
            self._muxes.clear()
        for channel, mux in made:
            mux.close()
            channel.close()
