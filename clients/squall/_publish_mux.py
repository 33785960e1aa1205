"""Publish streams a client shares between the one-at-a-time publishes of its publishers:
one through the gateway, and one to each replica address its publisher proxies are bound to.

Many threads each publishing one event at a time with a `Publisher` of their own used to
cost a stream per publisher: one request per event on every hop, with a gRPC message, a
thread hand-off and a stream read each (bench/README.md, issue 16). Here every gateway
publisher of one `Client` sends its lone `publish()` calls on one `PublishStream`: a call
that finds a free slot in the window goes out at once as a request of its own (a lone
publish never waits for a timer or for others); calls that arrive while the window is
full wait, and when a slot frees they go out together as one request. That request joins
the events per publisher (one part per publisher id and topic, its events in call order)
and, when more than one publisher is in it, carries the parts in `PublishRequest.parts`:
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
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import grpc

from squall._errors import Indeterminate, SquallError, error_for, rpc_status
from squall._proxy import Endpoint, master_address
from squall._publish_rules import (
    BATCH_EVENTS_DEFAULT,
    RECEIPT_STALL_AFTER_S,
    RECEIPT_STALL_CHECK_S,
    NotSent,
    abandon_stream,
    moved_trailing,
    new_request,
    new_session_token,
    not_sent_error,
    stall_details,
    stall_move,
    stream_end_errors,
)
from squall._types import Receipt, receipts_from_pb
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall.wire import stages as _stages

log = logging.getLogger("squall")

# The metadata asking the master to answer a failed request inline instead of ending the
# stream (services/common/errors.py, PUBLISH_ERRORS_KEY / INLINE_ERRORS).
INLINE_ERRORS_METADATA = (("squall-publish-errors", "inline"),)
# Requests unanswered on the shared stream at a time. A lone publish, and a second one
# beside it, go out at once; more callers wait and join. Fewer, larger requests cost less
# CPU per event on every hop, which is what bounds many callers on a small machine: in
# one cluster, alternating windows (2026-11-26, load 9-14, SYNC), 2 against 8 gave 1.6x
# the rate at 8 threads, ~2x at 16 and 1.2-1.6x at 64, with lower p50s, and the same
# one-at-a-time latency; 1 was no better than 2 at 8-64 and worse at 2 threads, 3 worse
# than 2.
SHARED_INFLIGHT_MAX = 2
# Most events, and bytes of keys and payloads, joined into one request: well within the
# master's max_batch_events (10,000) and the 64 MiB message limit; the rest waits for the
# next free slot.
JOIN_EVENTS_MAX = BATCH_EVENTS_DEFAULT
JOIN_BYTES_MAX = 4 * 1024 * 1024
# Statuses of a part answered inline that mean the stream's master can no longer take
# publishes: a slave's redirect (UNAVAILABLE) or a deposition (UNKNOWN). The stream asks
# for inline errors, so the master does not end it: the client abandons it, and the
# retries go through the gateway to the master it follows now.
_MASTER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})

Trailing = tuple[tuple[str, str], ...]
# Asks the gateway which replica is master ("" if it cannot say within the timeout given).
CheckMaster = Callable[[float], str]


class JoinRefused(NotSent):
    """A joined request (or part) was refused as a whole: nothing of it was stored, and the
    caller sends its event again alone, to learn whether the refusal was its own."""


@dataclasses.dataclass(eq=False)
class _Entry:
    """One event of one publisher, waiting or sent."""

    topic: str
    publisher_id: str
    event: common_pb2.EventData
    future: Future[Receipt]
    alone: bool
    size: int
    # The mux it was queued on, and the stream it was sent on (set when sent), so a caller
    # that times out abandons it.
    mux: PublishMux | None = None
    stream: _MuxStream | None = None
    # Set when it failed with its stream's end (or an answer saying the stream's replica
    # is no longer master): the status and trailing metadata a publisher proxy's binding
    # is told, as a stream of its own would tell it (`ProxyBinding.stream_failed`).
    ended: tuple[grpc.StatusCode, Trailing | None] | None = None


@dataclasses.dataclass(eq=False)
class _Sent:
    """One request on the stream: its parts (one per publisher and topic), in order."""

    request_id: int
    groups: list[list[_Entry]]
    joined: bool  # sent with PublishRequest.parts
    # When it was queued (time.monotonic): the stall watchdog waits on it.
    sent_at: float


class _MuxStream:
    """One open PublishStream: its request queue, unanswered requests and reader thread."""

    def __init__(self, generation: int, check_master: CheckMaster | None = None) -> None:
        self.generation = generation
        self.session_token = new_session_token("shared")
        self.requests: queue.SimpleQueue[broker_pb2.PublishRequest | None] = queue.SimpleQueue()
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

    def iter_requests(self) -> Iterator[broker_pb2.PublishRequest]:
        get = self.requests.get
        while (request := get()) is not None:
            if _stages.ENABLED:
                _stages.mark("c.wire", _request_key(request))
            yield request


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

    def submit(
        self,
        topic: str,
        publisher_id: str,
        event: common_pb2.EventData,
        *,
        alone: bool = False,
        metadata: Trailing = (),
        check_master: CheckMaster | None = None,
    ) -> tuple[Future[Receipt], _Entry]:
        """Queues one event; its future gets the receipt or the error of this attempt.

        `alone` keeps it out of joined requests (after `JoinRefused`). The caller holds its
        publisher's lock, so one publisher's events arrive here in sequence order. A
        publisher proxy gives its binding's request `metadata` and stall check, used if
        this call opens the stream.
        """
        future: Future[Receipt] = Future()
        future.set_running_or_notify_cancel()
        size = len(event.payload) + len(event.key)
        entry = _Entry(topic, publisher_id, event, future, alone, size, self)
        with self._lock:
            if self._closed:
                raise ValueError("the client is closed")
            stream = self._live_stream(metadata, check_master)
            self._waiting.append(entry)
            self._pump(stream)
        return future, entry

    def result(self, entry: _Entry, timeout_s: float) -> Receipt:
        """Waits for one attempt's receipt; past the timeout the stream it went on is
        abandoned (every request on it becomes indeterminate, and is retried by its caller)
        and, if even that outcome does not come, `Indeterminate`."""
        try:
            return entry.future.result(timeout_s)
        except FutureTimeoutError:
            with self._lock:
                stream = entry.stream
                if stream is None and entry in self._waiting:
                    # Never sent (the window stayed full): nothing to abandon.
                    self._waiting.remove(entry)
                    entry.future.set_exception(
                        error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "publish window stayed full")
                    )
                elif stream is not None:
                    self._abort(
                        stream,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no receipt within {timeout_s} s",
                    )
        try:
            return entry.future.result(timeout_s)
        except FutureTimeoutError:
            raise Indeterminate(
                f"no receipt within {timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    def close(self) -> None:
        """Half-closes the stream; events still waiting fail as not sent."""
        with self._lock:
            self._closed = True
            stream = self._stream
            self._stream = None
            waiting = list(self._waiting)
            self._waiting.clear()
        for entry in waiting:
            entry.future.set_exception(not_sent_error("the client was closed"))
        if stream is not None:
            stream.requests.put(None)

    # -- sending (lock held) ----------------------------------------------------------

    def _live_stream(self, metadata: Trailing, check_master: CheckMaster | None) -> _MuxStream:
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        self._generation += 1
        stream = _MuxStream(self._generation, check_master)
        stream.call = self._stub.PublishStream(
            stream.iter_requests(), metadata=INLINE_ERRORS_METADATA + metadata
        )
        self._stream = stream
        self.streams_opened += 1
        threading.Thread(
            target=self._read, args=(stream,), name="squall-publish-shared", daemon=True
        ).start()
        if self.endpoint is not None and check_master is not None:
            threading.Thread(
                target=self._watch, args=(stream,), name="squall-publish-watch-shared", daemon=True
            ).start()
        return stream

    def _pump(self, stream: _MuxStream) -> None:
        """Sends what waits while the window has room: the lone event at once, the events
        that gathered while it was full as one request."""
        waiting = self._waiting
        while waiting and len(stream.pending) < self._inflight_max and not stream.dead:
            take = [waiting.popleft()]
            if not take[0].alone and self._joins:
                events, size = 1, take[0].size
                while waiting and not waiting[0].alone:
                    nxt = waiting[0]
                    if events >= JOIN_EVENTS_MAX or size + nxt.size > JOIN_BYTES_MAX:
                        break
                    take.append(waiting.popleft())
                    events += 1
                    size += nxt.size
            self._send(stream, take)

    def _send(self, stream: _MuxStream, entries: list[_Entry]) -> None:
        by_publisher: dict[tuple[str, str], list[_Entry]] = {}
        for entry in entries:
            by_publisher.setdefault((entry.topic, entry.publisher_id), []).append(entry)
            entry.stream = stream
        groups = list(by_publisher.values())
        request_id = self._next_request_id
        self._next_request_id += 1
        token = stream.session_token
        if len(groups) == 1:
            request = _part(groups[0], token)
            request.request_id = request_id
        else:
            # The envelope names the first part's topic: a server's permission check sees
            # a topic the caller may publish to (and then checks every part's).
            request = broker_pb2.PublishRequest(topic=groups[0][0].topic, request_id=request_id)
            for number, group in enumerate(groups, 1):
                part = request.parts.add()
                part.CopyFrom(_part(group, token))
                part.request_id = number
            self.joined_requests += 1
        if not stream.pending:
            stream.woken.set()
        stream.pending.append(
            _Sent(request_id, groups, joined=len(groups) > 1, sent_at=time.monotonic())
        )
        if _stages.ENABLED:
            _stages.mark("c.queued", _request_key(request))
        stream.requests.put(request)

    def _abort(self, stream: _MuxStream, code: grpc.StatusCode, details: str) -> None:
        abandon_stream(stream, code, details)

    def _watch(self, stream: _MuxStream) -> None:
        """A replica stream's stall watchdog (its own thread), as a proxy's own stream has
        (`Publisher._watch`): once the oldest unanswered request is RECEIPT_STALL_AFTER_S
        old, asks every RECEIPT_STALL_CHECK_S who the master is and abandons the stream as
        soon as the gateway names another replica; its callers' proxies then move there."""
        endpoint, check = self.endpoint, stream.check_master
        if endpoint is None or check is None:
            return
        # Ends with the stream (`_fail` sets dead and wakes this thread).
        while not stream.dead:
            stream.woken.clear()
            with self._lock:
                oldest = stream.pending[0] if stream.pending else None
            if oldest is None:
                stream.woken.wait()
                continue
            late_in_s = oldest.sent_at + RECEIPT_STALL_AFTER_S - time.monotonic()
            if late_in_s > 0:
                stream.woken.wait(late_in_s)
                continue
            checked = check(RECEIPT_STALL_CHECK_S)
            with self._lock:
                still_waiting = (
                    not stream.dead and bool(stream.pending) and stream.pending[0] is oldest
                )
                master = stall_move("shared", endpoint, checked) if still_waiting else ""
                if master:
                    if stream.abort_error is None:
                        stream.moved_to = master
                    self._abort(
                        stream, grpc.StatusCode.UNAVAILABLE, stall_details(endpoint, master)
                    )
                    return
            if still_waiting:
                # On the wake event, not a sleep: the thread ends as soon as its stream does.
                stream.woken.wait(RECEIPT_STALL_CHECK_S)

    # -- the reader thread ------------------------------------------------------------

    def _read(self, stream: _MuxStream) -> None:
        """Hands each response's receipts (or errors) to their callers, in request order."""
        code = grpc.StatusCode.UNKNOWN
        details = "the server closed the publish stream without answering"
        trailing: Trailing | None = None
        try:
            for response in stream.call:
                with self._lock:
                    sent = stream.pending.popleft() if stream.pending else None
                    if sent is None or not _answers(sent, response):
                        if sent is not None:
                            stream.pending.appendleft(sent)
                        stream.abort_error = Indeterminate(
                            f"protocol error: answer to request {response.request_id} does "
                            "not match the oldest unanswered one",
                            grpc.StatusCode.INTERNAL,
                        )
                        stream.call.cancel()
                        break
                    self._pump(stream)
                if _stages.ENABLED:
                    _stages.mark("c.resp", _entry_key(sent.groups[0][0]))
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
        except grpc.RpcError as err:
            code, details = rpc_status(err)
            trailing_fn = getattr(err, "trailing_metadata", None)
            trailing = _plain(trailing_fn()) if callable(trailing_fn) else None
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come.
            log.exception("squall: the shared publish stream's reader failed")
            with self._lock:
                self._abort(
                    stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
                )
        self._fail(stream, code, details, trailing)

    def _settle(self, sent: _Sent, response: broker_pb2.PublishResponse) -> str | None:
        """Resolves the futures of one answered request. Not None if the master is gone:
        the master a slave's redirect names, or ""."""
        if response.HasField("error"):
            error = _inline_error(response.error)
            ended = _ended(error, response.error)
            if (
                sent.joined
                and not error.maybe_stored
                and error.code == grpc.StatusCode.INVALID_ARGUMENT
            ):
                # A server without parts: join no more, each event goes again alone.
                with self._lock:
                    if self._joins:
                        log.info("squall: the server refused a joined publish (%s)", error)
                    self._joins = False
            for group in sent.groups:
                _fail_group(group, error, many=sent.joined, ended=ended)
            return _gone(ended)
        if not sent.joined:
            return _answer(sent.groups[0], response)
        gone: str | None = None
        if len(response.parts) != len(sent.groups):
            error = Indeterminate(
                f"protocol error: {len(response.parts)} answers to {len(sent.groups)} parts",
                grpc.StatusCode.INTERNAL,
            )
            for group in sent.groups:
                _fail_group(group, error, many=False)
            return ""
        for group, answer in zip(sent.groups, response.parts, strict=True):
            part_gone = _answer(group, answer)
            if part_gone is not None and not gone:
                gone = part_gone
        return gone

    def _fail(
        self,
        stream: _MuxStream,
        code: grpc.StatusCode,
        details: str,
        trailing: Trailing | None = None,
    ) -> None:
        """Ends a stream: its oldest request gets the status, the others are indeterminate,
        and events still waiting fail as not sent (their callers send them again).
        Each of them keeps how the stream ended (`_Entry.ended`)."""
        with self._lock:
            stream.dead = True
            stream.woken.set()
            pending = list(stream.pending)
            stream.pending.clear()
            waiting: list[_Entry] = []
            if self._stream is stream or self._stream is None:
                self._stream = None
                waiting = list(self._waiting)
                self._waiting.clear()
        stream.requests.put(None)  # ends gRPC's request-consumer thread
        first, rest = stream_end_errors(code, details, stream.abort_error)
        end_code = stream.abort_error.code if stream.abort_error is not None else code
        ended = (end_code, moved_trailing(stream.moved_to) if stream.moved_to else trailing)
        for index, sent in enumerate(pending):
            error = first if index == 0 else rest
            for group in sent.groups:
                _fail_group(group, error, many=sent.joined, ended=ended)
        unsent = not_sent_error(details)
        for entry in waiting:
            entry.ended = ended
            entry.future.set_exception(unsent)


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


def _answers(sent: _Sent, response: broker_pb2.PublishResponse) -> bool:
    """Whether a response answers the oldest unanswered request: its id, or no id on a
    failure answered inline (the master answers those in order without echoing it)."""
    if response.request_id == sent.request_id:
        return True
    return response.request_id == 0 and response.HasField("error")


def _request_key(request: broker_pb2.PublishRequest) -> str:
    """A request's key in the latency budget's stage marks (squall.wire.stages): its
    first publisher's id and first sequence, as a publisher's own stream marks it."""
    first = request.parts[0] if request.parts else request
    sequence = first.events[0].sequence if first.events else 0
    return _stages.request_key(first.publisher_id, sequence)


def _entry_key(entry: _Entry) -> str:
    return _stages.request_key(entry.publisher_id, entry.event.sequence)


def _part(group: list[_Entry], token: str) -> broker_pb2.PublishRequest:
    """One publisher's events of a request, in call order."""
    request = new_request(group[0].topic, group[0].publisher_id, token)
    request.events.extend(entry.event for entry in group)
    return request


def _inline_error(error: broker_pb2.PublishError) -> SquallError:
    """The error a request answered inline would have ended the stream with."""
    code = getattr(grpc.StatusCode, error.code or "UNKNOWN", grpc.StatusCode.UNKNOWN)
    return error_for(code, error.message or code.name.lower(), sent=True)


def _fail_group(
    group: list[_Entry],
    error: SquallError,
    *,
    many: bool,
    ended: tuple[grpc.StatusCode, Trailing | None] | None = None,
) -> None:
    """Fails one part's callers. A definite refusal of several events at once (or of a
    joined request) is not theirs to keep: each is sent again alone (`JoinRefused`)."""
    if (len(group) > 1 or many) and not error.maybe_stored and not isinstance(error, NotSent):
        error = JoinRefused(f"refused with others, to be sent alone: {error.details}", error.code)
    for entry in group:
        if not entry.future.done():
            entry.ended = ended
            entry.future.set_exception(error)


def _plain(metadata: Any) -> Trailing:
    """Trailing metadata as (key, str) pairs."""
    return tuple(
        (key, value.decode() if isinstance(value, bytes) else value)
        for key, value in metadata or ()
    )


def _ended(
    error: SquallError, answer: broker_pb2.PublishError
) -> tuple[grpc.StatusCode, Trailing | None] | None:
    """How an error answered inline ends its callers' binding to the stream's replica: as
    the stream would have ended, with the metadata (a slave's `squall-master-address`), if
    it says the replica is no longer master; else None (the caller's own refusal)."""
    if error.code not in _MASTER_GONE:
        return None
    return error.code, tuple(sorted(answer.metadata.items()))


def _gone(ended: tuple[grpc.StatusCode, Trailing | None] | None) -> str | None:
    """None unless the master is gone; then the master a redirect names, or ""."""
    return None if ended is None else master_address(ended[1])


def _answer(group: list[_Entry], response: broker_pb2.PublishResponse) -> str | None:
    """Hands one part's receipts to its callers; not None if it failed as the master gone
    (the master a slave's redirect names, or "")."""
    if response.HasField("error"):
        error = _inline_error(response.error)
        ended = _ended(error, response.error)
        _fail_group(group, error, many=False, ended=ended)
        return _gone(ended)
    receipts = receipts_from_pb(response)
    if len(receipts) != len(group):
        error = Indeterminate(
            f"protocol error: {len(receipts)} receipts for {len(group)} events",
            grpc.StatusCode.INTERNAL,
        )
        _fail_group(group, error, many=False)
        return ""
    for entry, receipt in zip(group, receipts, strict=True):
        entry.future.set_result(receipt)
    return None
