"""One publish stream per asyncio client, shared by the lone publishes of all its publishers.

The asyncio counterpart of `squall._publish_mux` (its docstring gives the reasons and the
rules; the joining itself is `squall._publish_join`'s, shared by both). Every gateway
publisher of one `squall.aio.Client` sends its lone `publish()` calls here. What is
submitted goes out at the end of the event loop's turn if the window has a free slot (no
timer, no waiting for others): the calls made in one turn, such as the tasks one answer
woke publishing again, go as one request; calls that arrive while the window is full
wait, and when a slot frees they go out together as one request. A request carries one
part per publisher id and topic (`PublishRequest.parts`), which the master publishes part
by part and answers apart.

Rules kept, as in the threaded stream: per-publisher order (a publisher submits with no
`await` between assigning a sequence and queuing the event, and its own stream sends
nothing while one of its publishes is here); errors stay with their caller (failures are
answered inline, a refusal shared with others is `JoinRefused` and sent again alone);
retries are the caller's (`Publisher._publish_muxed`, same publisher id and sequence,
so the master's deduplication stores the event once); a part answered as by a master
that is no longer one abandons the stream; a caller past its timeout abandons the stream
its event went on (or withdraws the event if it was never sent).

Cancellation: a task cancelled while its event waits for a slot withdraws the event (it
is never sent; its sequence is skipped, which the master allows). Once sent, the event
stays on the stream: it is stored or refused as if the caller still waited, and nobody
retries it; the publisher's later events still follow it.

Publisher proxies (`replicated=True/False`) share too, one stream per replica address
(`ProxyMuxes`, a `PublishMux` per address made on demand, closed with the client), with
the threaded `ProxyMuxes`' rules (`squall._publish_mux`'s docstring): every attempt,
retries included, goes on the stream to the replica the proxy's own binding
(`squall._proxy.ProxyBinding`) names then, opened with the binding's request metadata
(`squall-unreachable`) if new; how the attempt ended (the stream's status and trailing
metadata, or a slave's redirect answered inline) is kept in `Entry.ended` and told to
that binding alone (`Publisher._mux_attempt`), so a `replicated=False` proxy is lost and
raises `PublisherLost` while a replicated one moves; a redirect also abandons the stream
naming the master (`_MuxStream.moved_to`), so the proxies of the other requests on it
follow; a replica stream has the stall watchdog a proxy's own stream has (`_watch`, a
task); the first answer a proxy gets from another replica is its move (`on_rebind`,
`Receipt.rebound`). A cancelled proxy caller is as above: its binding hears nothing of
an attempt nobody awaits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from squall._errors import Indeterminate, SquallError, error_for, rpc_status
from squall._proxy import Endpoint
from squall._publish_join import (
    INLINE_ERRORS_METADATA,
    SHARED_INFLIGHT_MAX,
    Entry,
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
    abandon_stream,
    moved_trailing,
    new_session_token,
    not_sent_error,
    status_lost_trailing,
)
from squall._types import Receipt
from squall.aio._deadline import within
from squall.aio._stall_watch import MasterCheck, watch_stalls
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from squall.wire import stages as _stages

log = logging.getLogger("squall")

MuxEntry = Entry[asyncio.Future[Receipt]]
_Sent = Sent[asyncio.Future[Receipt]]


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Marks the exception of a future nobody awaits any more (a cancelled caller's) as
    seen, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class _MuxStream:
    """One open PublishStream: its request queue, unanswered requests and reader task."""

    def __init__(self, generation: int, check_master: MasterCheck | None = None) -> None:
        self.generation = generation
        self.session_token = new_session_token("shared")
        # Bounded by the window: a request is only queued with a free slot.
        self.requests: asyncio.Queue[broker_pb2.PublishRequest | None] = asyncio.Queue()
        self.pending: collections.deque[_Sent] = collections.deque()
        self.dead = False
        self.abort_error: SquallError | None = None
        # Set when abandoned because another replica is master now (a slave's redirect
        # answered inline, or the stall watchdog): its callers' proxies follow it.
        self.moved_to = ""
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None
        # A replica stream's stall check (the opening proxy's), its watchdog task, and
        # what wakes it: a request sent while none was pending, or the stream's end.
        self.check_master = check_master
        self.watchdog: asyncio.Task[None] | None = None
        self.woken = asyncio.Event()

    async def iter_requests(self) -> AsyncIterator[broker_pb2.PublishRequest]:
        """The request iterator gRPC consumes; ends at the None sentinel."""
        while (request := await self.requests.get()) is not None:
            if _stages.ENABLED:
                _stages.mark("c.wire", request_key(request))
            yield request


class PublishMux:
    """An asyncio client's shared publish stream for one-at-a-time publishes (see the
    module doc). Used from the one event loop the client runs on."""

    def __init__(
        self,
        stub: Any,
        *,
        timeout_s: float = 10.0,
        inflight_max: int = SHARED_INFLIGHT_MAX,
        endpoint: Endpoint | None = None,
    ) -> None:
        self._stub = stub
        # The replica this mux's streams go to (None: through the gateway).
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._inflight_max = inflight_max
        self._stream: _MuxStream | None = None
        self._waiting: collections.deque[MuxEntry] = collections.deque()
        self._next_request_id = 1
        self._generation = 0
        # Off once a server refused a joined request whole (it knows no parts).
        self._joins = True
        # A send of what waits is queued for the end of the loop's turn (`submit`).
        self._pump_due = False
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
        check_master: MasterCheck | None = None,
    ) -> MuxEntry:
        """Queues one event (sent at once if a slot is free); its future gets the receipt
        or the error of this attempt. `alone` keeps it out of joined requests (after
        `JoinRefused`). No `await` here: events are queued in call order. A publisher
        proxy gives its binding's request `metadata` and stall check, used if this call
        opens the stream."""
        if self._closed:
            raise ValueError("the client is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Receipt] = loop.create_future()
        entry = new_entry(topic, publisher_id, event, future, alone, self)
        self._live_stream(metadata, check_master)
        self._waiting.append(entry)
        if not self._pump_due:
            # At the end of this turn, not now: the tasks one answer wakes publish again in
            # the same turn, and their events then go as one request. Sent at once, the
            # first of them took the free slot alone and the rest waited for the next one:
            # with 64 tasks sharing a publisher, a third of the requests carried one event
            # and the rest 62 (bench/README.md, *Sends at the end of the loop's turn*).
            self._pump_due = True
            loop.call_soon(self._pump_turn)
        return entry

    def _pump_turn(self) -> None:
        """What the turn's `submit` calls queued goes out (the stream a call opened, unless
        it has ended since and failed them)."""
        self._pump_due = False
        stream = self._stream
        if stream is not None and not self._closed:
            self._pump(stream)

    async def result(self, entry: MuxEntry, timeout_s: float) -> Receipt:
        """Waits for one attempt's receipt; past the timeout the stream it went on is
        abandoned (every request on it becomes indeterminate, and is retried by its caller)
        and, if even that outcome does not come, `Indeterminate`. A cancelled caller's
        event is withdrawn if it was not sent yet (see the module doc)."""
        try:
            return await within(entry.future, timeout_s)
        except TimeoutError:
            if entry.stream is None and entry in self._waiting:
                # Never sent (the window stayed full): nothing to abandon.
                self._waiting.remove(entry)
                entry.future.set_exception(
                    error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "publish window stayed full")
                )
            elif entry.stream is not None:
                abandon_stream(
                    entry.stream,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no receipt within {timeout_s} s",
                )
        except asyncio.CancelledError:
            if entry.stream is None and entry in self._waiting:
                self._waiting.remove(entry)
                entry.future.set_exception(not_sent_error("the publishing task was cancelled"))
            entry.future.add_done_callback(_retrieved)
            raise
        try:
            return await within(entry.future, timeout_s)
        except TimeoutError:
            raise Indeterminate(
                f"no receipt within {timeout_s} s", grpc.StatusCode.DEADLINE_EXCEEDED
            ) from None

    async def close(self) -> None:
        """Half-closes the stream and waits (up to the timeout) for the answers to what
        was sent; events still waiting fail as not sent."""
        if self._closed:
            return
        self._closed = True
        stream, self._stream = self._stream, None
        waiting = list(self._waiting)
        self._waiting.clear()
        for entry in waiting:
            entry.future.set_exception(not_sent_error("the client was closed"))
        if stream is None:
            return
        stream.requests.put_nowait(None)  # half-close: the server ends the stream
        if stream.reader is not None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    await asyncio.shield(stream.reader)
            except TimeoutError:
                stream.call.cancel()
        if stream.watchdog is not None:
            stream.watchdog.cancel()

    # -- sending ----------------------------------------------------------------------

    def _live_stream(self, metadata: Trailing, check_master: MasterCheck | None) -> _MuxStream:
        stream = self._stream
        if stream is not None and not stream.dead:
            return stream
        self._generation += 1
        stream = _MuxStream(self._generation, check_master)
        stream.call = self._stub.PublishStream(
            stream.iter_requests(),
            metadata=grpc.aio.Metadata(*INLINE_ERRORS_METADATA, *metadata),
        )
        self._stream = stream
        self.streams_opened += 1
        loop = asyncio.get_running_loop()
        stream.reader = loop.create_task(self._read(stream), name="squall-publish-shared")
        if self.endpoint is not None and check_master is not None:
            stream.watchdog = loop.create_task(
                watch_stalls(stream, self.endpoint, check_master, "shared"),
                name="squall-publish-watch-shared",
            )
        return stream

    def _pump(self, stream: _MuxStream) -> None:
        """Sends what waits while the window has room, as one request (up to the joining
        limits): the events of one turn, or those that gathered while it was full."""
        waiting = self._waiting
        while waiting and len(stream.pending) < self._inflight_max and not stream.dead:
            request_id = self._next_request_id
            self._next_request_id += 1
            request, sent = build_request(
                take_next(waiting, self._joins),
                stream.session_token,
                request_id,
                stream,
                asyncio.get_running_loop().time(),
            )
            self.joined_requests += sent.joined
            if not stream.pending:
                stream.woken.set()
            stream.pending.append(sent)
            if _stages.ENABLED:
                _stages.mark("c.queued", request_key(request))
            stream.requests.put_nowait(request)

    # -- the reader task --------------------------------------------------------------

    async def _read(self, stream: _MuxStream) -> None:
        """Hands each response's receipts (or errors) to their callers, in request order."""
        code = grpc.StatusCode.UNKNOWN
        details = "the server closed the publish stream without answering"
        trailing: Trailing | None = None
        try:
            async for response in stream.call:
                sent = stream.pending.popleft() if stream.pending else None
                if sent is None or not answers(sent, response):
                    if sent is not None:
                        stream.pending.appendleft(sent)
                    stream.abort_error = mismatch_error(response)
                    stream.call.cancel()
                    break
                self._pump(stream)  # the slot this answer freed
                if _stages.ENABLED:
                    _stages.mark("c.resp", entry_key(sent.groups[0][0]))
                if refuses_parts(sent, response) and self._joins:
                    # A server without parts: join no more, each event goes again alone.
                    log.info(
                        "squall: the server refused a joined publish (%s)",
                        inline_error(response.error),
                    )
                    self._joins = False
                gone = settle(sent, response)
                if gone is not None:
                    if gone and not stream.dead and stream.abort_error is None:
                        # A slave's redirect: the other callers' proxies follow it too.
                        stream.moved_to = gone
                    abandon_stream(
                        stream,
                        grpc.StatusCode.UNAVAILABLE,
                        "the master answered a publish as no longer master",
                    )
        except grpc.aio.AioRpcError as err:
            code, details = rpc_status(err)
            trailing = plain(status_lost_trailing(code, details, err.trailing_metadata()))
        except asyncio.CancelledError:
            # grpc.aio raises this when the call was cancelled here (by abandon_stream,
            # which gave a reason) or by the loop shutting down.
            if stream.abort_error is None:
                stream.abort_error = Indeterminate(
                    "the publish stream was cancelled", grpc.StatusCode.CANCELLED
                )
        except Exception as exc:
            # A bug here must not leave callers waiting on receipts that never come.
            log.exception("squall: the shared publish stream's reader failed")
            abandon_stream(
                stream, grpc.StatusCode.INTERNAL, f"client failed reading receipts: {exc!r}"
            )
        self._fail(stream, code, details, trailing)

    def _fail(
        self,
        stream: _MuxStream,
        code: grpc.StatusCode,
        details: str,
        trailing: Trailing | None = None,
    ) -> None:
        """Ends a stream: its oldest request gets the status, the others are indeterminate,
        and events still waiting fail as not sent (their callers send them again).
        Each of them keeps how the stream ended (`Entry.ended`)."""
        stream.dead = True
        stream.woken.set()
        pending = list(stream.pending)
        stream.pending.clear()
        waiting: list[MuxEntry] = []
        if self._stream is stream or self._stream is None:
            self._stream = None
            waiting = list(self._waiting)
            self._waiting.clear()
        stream.requests.put_nowait(None)  # ends gRPC's request consumer, waiting on our queue
        end_code = stream.abort_error.code if stream.abort_error is not None else code
        ended = (end_code, moved_trailing(stream.moved_to) if stream.moved_to else trailing)
        fail_ended(pending, code, details, stream.abort_error, ended)
        unsent = not_sent_error(details)
        for entry in waiting:
            if not entry.future.done():
                entry.ended = ended
                entry.future.set_exception(unsent)


class ProxyMuxes:
    """An asyncio client's shared streams to replicas, one `PublishMux` per replica
    address, made when a publisher proxy bound there first publishes alone, closed with
    the client (see the module doc)."""

    def __init__(self, *, timeout_s: float = 10.0, inflight_max: int = SHARED_INFLIGHT_MAX) -> None:
        self._timeout_s = timeout_s
        self._inflight_max = inflight_max
        self._muxes: dict[str, tuple[Any, PublishMux]] = {}
        self._closed = False

    def get(self, endpoint: Endpoint, make_channel: Callable[[str], Any]) -> PublishMux:
        """The shared stream to `endpoint`'s address; `make_channel(address)` opens its
        channel the first time (the client owns it from then on)."""
        if self._closed:
            raise ValueError("the client is closed")
        made = self._muxes.get(endpoint.address)
        if made is None:
            channel = make_channel(endpoint.address)
            mux = PublishMux(
                broker_pb2_grpc.PublisherStub(channel),
                timeout_s=self._timeout_s,
                inflight_max=self._inflight_max,
                endpoint=endpoint,
            )
            made = self._muxes[endpoint.address] = (channel, mux)
        return made[1]

    def addresses(self) -> list[str]:
        """The replica addresses with a shared stream (made so far)."""
        return sorted(self._muxes)

    async def close(self) -> None:
        """Closes every shared stream (waiting for what was sent, as `PublishMux.close`)
        and its channel."""
        self._closed = True
        made = list(self._muxes.values())
        self._muxes.clear()
        for channel, mux in made:
            await mux.close()
            await channel.close(None)
