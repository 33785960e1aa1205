"""One long-lived `PublishStream` per master that carries many callers' unary publishes.

A unary `Publish` forwarded as a unary call pays a new HTTP/2 stream and a new server
call on the master for every event. The gateway instead writes each deduplicated unary
publish (publisher id and a sequence on every event: `retry.publish_deduplicated`) as one
request of a `PublishStream` it keeps open to the master, shared by every caller with the
same forwarded credentials (joined with other callers' when they wait: "Joining" below),
and hands each caller the response that answers its request (the master answers a
stream's requests in order, so the n-th response answers the n-th request written).

What a caller can hear (`SharedStreamError`, read like a forwarded call's status by
`squall_server.gateway.forward`, which retries under the same rules):

* its response, byte for byte;
* its own failure, answered inline (`PublishResponse.error`): the stream asks the master
  for that (`squall-publish-errors: inline`), so one caller's refusal (a missing topic, a
  sequence below the dedupe window) does not end the others' requests;
* the stream's status when the stream ended at its request (a master that does not
  answer inline, or a failure that is not one request's: a guard's refusal, a
  deposition): the master answers every
  earlier request before it ends a stream with one request's failure (`PublishStream`'s
  contract; a guard's refusal also answers the requests it took first), so the oldest
  unanswered request is the one that failed, and gets the status as it came (a definite
  refusal stays definite, a slave's redirect stays a redirect);
* for every later unanswered request, an indeterminate `collateral` failure: the master
  may have started it. Only deduplicated publishes share a stream, so the forwarder sends
  them again under the same ids (at once when the stream ended on another call's definite
  failure: the master is fine) and the master stores each event once;
* DEADLINE_EXCEEDED when its attempt's time ran out (indeterminate once its request was
  written, definite before: `forwarded`).

Joining (`Joining`): a lone publish, and a second beside it, are written at once, in the
caller's own task. While `window` requests are unanswered, more callers wait, and the next
request carries all of them as one `PublishRequest.parts` (built without parsing: each
caller's bytes are one part), which the master plans, stores and replicates as one write
and answers with one answer per part. Each caller hears its part as if it were its own
request's response, byte for byte, or its own refusal. Fewer, larger requests are what
let many callers share the master's work (issue 16: about twice the rate for 64 unary
callers, the master's CPU per event a third; bench/README.md, "Joining apps' unary
publishes at the gateway"). A joined request the master fails as a
whole is heard by each of its callers as their own request would have been, except a
definite refusal (which may be the joining's own: more parts than the master's limits
allow): nothing of it was applied, each caller is sent again alone, and the link stops
joining. Callers still waiting when the stream ends were never written: they go again
through the forwarder (to the master it follows by then).

Back-pressure: at most `inflight_max` callers are unanswered or waiting on one link (the
replica's per-client limit counts the stream as one client); more callers wait for a
slot within their attempt's time. A caller that gives up (deadline, cancellation) leaves
its slot taken until the master answers its request, so the master never holds more; one
that gives up before it was written frees its slot at once.
A write that is cut off (its writer cancelled in the middle) ends the stream, since the
pairing of responses to requests could no longer be trusted; the other callers retry.

When the group views move the master away from a stream's replica, the stream is
cancelled (a paused master cannot end it itself) and its callers retry at the new one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from squall.v1 import broker_pb2
from squall.wire.retry import classify, status_lost
from squall_server.common.errors import INLINE_ERRORS, PUBLISH_ERRORS_KEY
from squall_server.gateway.master import Master, MasterTracker, pairs

log = logging.getLogger("squall.gateway")

PUBLISH_STREAM_PATH = "/squall.v1.Publisher/PublishStream"

_Metadata = tuple[tuple[str, str | bytes], ...]

# Requests unanswered on a stream before more callers wait to be joined. As for the
# library's shared stream (squall._publish_join.SHARED_INFLIGHT_MAX): fewer, larger
# requests cost less CPU per event on every hop, and a lone call is never held.
JOIN_WINDOW = 2
# Most parts and bytes in one joined request: within the master's max_batch_events and
# message limits (`joining_for` lowers them to the configured ones).
JOIN_PARTS_MAX = 1024
JOIN_BYTES_MAX = 4 * 1024 * 1024


class SharedStreamError(Exception):
    """How one request on a shared publish stream ended, read as a forwarded call's status."""

    def __init__(
        self,
        code: str,
        details: str,
        trailing: _Metadata = (),
        *,
        forwarded: bool = True,
        collateral: bool = False,
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing
        # False: the request never left the gateway (nothing can have been applied).
        self.forwarded = forwarded
        # True: the stream ended on another caller's definite failure; the master is fine.
        self.collateral = collateral


def _inline_error(response: bytes) -> SharedStreamError | None:
    """The failure a master answered inline (PublishResponse.error), None for receipts."""
    parsed = broker_pb2.PublishResponse.FromString(response)
    if not parsed.HasField("error"):
        return None
    return _answered_error(parsed.error)


def _answered_error(error: broker_pb2.PublishError) -> SharedStreamError:
    return SharedStreamError(error.code or "UNKNOWN", error.message, tuple(error.metadata.items()))


def _seen(future: asyncio.Future[bytes]) -> None:
    """Marks an answer whose caller gave up as observed (no "never retrieved" warning)."""
    if not future.cancelled():
        future.exception()


def joining_for(max_batch_events: int, max_message_bytes: int) -> Joining:
    """The joining bounds within a master's configured limits (`[limits]`): no more parts
    than max_batch_events allows, and room in a message for a part's tag and length."""
    return Joining(
        parts_max=max(1, min(JOIN_PARTS_MAX, max_batch_events)),
        bytes_max=max(0, min(JOIN_BYTES_MAX, max_message_bytes - 1024)),
    )


def _fail(callers: Iterable[_Caller], error: Callable[[], SharedStreamError]) -> None:
    """Fails every caller still waiting for its answer, each with an error of its own."""
    for caller in callers:
        if not caller.answer.done():
            caller.answer.set_exception(error())


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# PublishRequest.parts: field 7, length-delimited.
_PARTS_TAG = b"\x3a"


def joined_request(requests: list[bytes]) -> bytes:
    """A PublishRequest whose parts are these serialized requests, built without parsing
    them: a message is the concatenation of its fields, and each part is one field 7."""
    return b"".join(b"".join((_PARTS_TAG, _varint(len(r)), r)) for r in requests)


@dataclass(frozen=True)
class Joining:
    """How a link joins the publishes that wait for it into one request (`parts`).

    While `window` requests are unanswered on the stream, more callers wait, and the next
    request carries every waiting caller's publish as one part each, up to `parts_max`
    parts and `bytes_max` bytes (the rest go in the request after). A lone publish, and a
    second beside it, are written at once: joining costs nothing when nothing waits.
    """

    window: int = JOIN_WINDOW
    parts_max: int = JOIN_PARTS_MAX
    bytes_max: int = JOIN_BYTES_MAX


@dataclass(eq=False)
class _Caller:
    """One caller's publish: its serialized request and the future of its answer."""

    request: bytes
    answer: asyncio.Future[bytes]
    # Taken to be written: from then on the master may apply it.
    written: bool = False


@dataclass(frozen=True)
class Backlog:
    """Unary publishes waiting at the gateway for room on its shared streams, requests
    written on them that the master has not answered, and the publishes those requests
    carry (``squall.gateway.publish.*``)."""

    waiting: int = 0
    unanswered: int = 0
    in_flight: int = 0

    def __add__(self, other: Backlog) -> Backlog:
        return Backlog(
            self.waiting + other.waiting,
            self.unanswered + other.unanswered,
            self.in_flight + other.in_flight,
        )


@dataclass(eq=False)
class _Sent:
    """One request written to the stream: one caller's, or several callers' joined."""

    callers: list[_Caller]

    @property
    def joined(self) -> bool:
        """Carried as `parts` (several callers' requests), not as one caller's bytes."""
        return len(self.callers) > 1


@dataclass
class _Stream:
    """One open PublishStream and the requests waiting for its responses, in write order."""

    call: grpc.aio.StreamStreamCall[bytes, bytes]
    pending: collections.deque[_Sent] = field(default_factory=collections.deque)
    reader: asyncio.Task[None] | None = None
    moved: asyncio.Task[Master] | None = None
    ended: bool = False


class SharedPublishStream:
    """The shared publish stream to one replica for one set of forwarded credentials."""

    def __init__(
        self,
        masters: MasterTracker,
        address: str,
        metadata: _Metadata,
        inflight_max: int,
        name: str,
        joining: Joining | None = Joining(),
    ) -> None:
        self._masters = masters
        self.address = address
        # The master answers a failed request inline and goes on (a master that does not
        # know the key ends the stream at it instead; both are handled).
        self._metadata = (*metadata, (PUBLISH_ERRORS_KEY, INLINE_ERRORS))
        self._slots = asyncio.Semaphore(inflight_max)
        self._inflight_max = inflight_max
        # None: every publish goes as a request of its own (also once a master refused a
        # joined request as a whole).
        self._joining = joining
        self._write_lock = asyncio.Lock()
        self._stream: _Stream | None = None
        # Callers waiting for room on the stream, oldest first; the joiner writes them.
        self._waiting: collections.deque[_Caller] = collections.deque()
        self._joiner: asyncio.Task[None] | None = None
        self.name = name
        # How many streams this link has opened (1 while nothing broke one).
        self.opened = 0
        # Requests written, and publishes carried in joined ones.
        self.requests = 0
        self.joined = 0

    @property
    def joining(self) -> bool:
        """Whether waiting publishes are still joined (a whole refusal stops it)."""
        return self._joining is not None

    def _window(self) -> int:
        return self._joining.window if self._joining is not None else self._inflight_max

    def backlog(self) -> Backlog:
        """What waits on this link now: callers not yet written (those that gave up are
        not counted), requests written that the master has not answered, and the
        publishes they carry."""
        waiting = sum(not caller.answer.done() for caller in self._waiting)
        stream = self._stream
        carried = (
            0
            if stream is None or stream.ended
            else sum(len(sent.callers) for sent in stream.pending)
        )
        return Backlog(waiting, self._unanswered(), carried)

    def _unanswered(self) -> int:
        stream = self._stream
        return 0 if stream is None or stream.ended else len(stream.pending)

    def _open(self) -> _Stream:
        """The current stream, opening one (and its reader) when there is none."""
        stream = self._stream
        if stream is not None and not stream.ended:
            return stream
        call = self._masters.channel_to(self.address).stream_stream(
            PUBLISH_STREAM_PATH, None, None
        )(None, metadata=self._metadata)
        stream = _Stream(call)
        stream.reader = asyncio.create_task(self._read(stream), name=f"{self.name}-reader")
        master = self._masters.master
        if master is not None and master.replica_address == self.address:
            # Only a stream to the master follows it: one opened to a redirect's target
            # before the views name it would be cancelled at once.
            stream.moved = asyncio.ensure_future(self._masters.moved_from(self.address))
            stream.moved.add_done_callback(lambda done: self._moved(stream, done))
        self._stream = stream
        self.opened += 1
        return stream

    def _moved(self, stream: _Stream, done: asyncio.Future[Master]) -> None:
        if done.cancelled() or stream.ended:
            return
        log.info(
            "gateway: shared publish stream to %s ended: the master is now %s "
            "(%d requests unanswered, sent again there)",
            self.address,
            done.result().node_id,
            len(stream.pending),
        )
        stream.call.cancel()

    async def publish(self, request: bytes, timeout_s: float | None) -> bytes:
        """Writes one serialized PublishRequest and returns the serialized response.

        Raises SharedStreamError (see the module docstring) for every other ending.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        caller = await self.submit(request, deadline)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(caller.answer)
        except TimeoutError:
            if not caller.written:
                caller.answer.cancel()
                raise SharedStreamError(
                    "DEADLINE_EXCEEDED",
                    "the gateway's publish stream to the master stayed full until the "
                    "call's deadline; the request was not forwarded",
                    forwarded=False,
                ) from None
            raise SharedStreamError(
                "DEADLINE_EXCEEDED",
                "the master did not answer the publish within the call's deadline; it may "
                "or may not have been applied",
            ) from None
        except asyncio.CancelledError:
            if not caller.written:
                caller.answer.cancel()  # never written: its slot is free at once
            raise

    async def submit(self, request: bytes, deadline: float | None = None) -> _Caller:
        """Takes one serialized PublishRequest (waiting for a slot until `deadline`, loop
        time): written at once when nothing waits and the stream has room, else queued to
        be joined. Its answer fails with a SharedStreamError."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise SharedStreamError(
                "DEADLINE_EXCEEDED",
                "the gateway's publish stream to the master stayed full until the call's "
                "deadline; the request was not forwarded",
                forwarded=False,
            ) from None
        answer: asyncio.Future[bytes] = loop.create_future()
        # The slot is the master's: it is freed when the master answers (or the stream
        # ends), not when this caller stops waiting.
        answer.add_done_callback(lambda _done: self._slots.release())
        answer.add_done_callback(_seen)
        caller = _Caller(request, answer)
        if self._waiting or self._write_lock.locked() or self._unanswered() >= self._window():
            self._waiting.append(caller)
            self._wake_joiner()
            return caller
        # Written in the caller's own task: a lone publish waits for no other task.
        caller.written = True
        try:
            await self._send([caller], deadline)
        except BaseException:
            if not answer.done():
                answer.cancel()
            raise
        self._wake_joiner()
        return caller

    def _wake_joiner(self) -> None:
        """Starts the joiner when callers wait and the stream has room for a request."""
        if not self._waiting or self._unanswered() >= self._window():
            return
        if self._joiner is None or self._joiner.done():
            self._joiner = asyncio.create_task(self._join(), name=f"{self.name}-joiner")

    async def _join(self) -> None:
        """Writes the waiting callers, joined, while the stream has room."""
        try:
            async with self._write_lock:
                for _ in range(len(self._waiting)):  # bounded: each turn takes a caller or ends
                    if self._unanswered() >= self._window():
                        return
                    callers = self._take()
                    if not callers:
                        return
                    await self._write(callers)
        finally:
            if self._waiting:
                # Callers that came while this ran found it running: look again once it
                # has ended.
                asyncio.get_running_loop().call_soon(self._wake_joiner)

    def _take(self) -> list[_Caller]:
        """The oldest waiting callers that fit one request (callers that gave up dropped)."""
        joining = self._joining
        taken: list[_Caller] = []
        size = 0
        for _ in range(len(self._waiting)):
            caller = self._waiting[0]
            if caller.answer.done():  # gave up before it was written
                self._waiting.popleft()
                continue
            if taken and (
                joining is None
                or len(taken) >= joining.parts_max
                or size + len(caller.request) > joining.bytes_max
            ):
                break
            self._waiting.popleft()
            caller.written = True
            taken.append(caller)
            size += len(caller.request) + 6  # a part's tag and length
        return taken

    async def _send(self, callers: list[_Caller], deadline: float | None) -> None:
        """Writes one request for these callers under the write lock (waiting for it until
        `deadline`)."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._write_lock.acquire()
        except TimeoutError:
            raise SharedStreamError(
                "DEADLINE_EXCEEDED",
                "the gateway's publish stream to the master stayed busy until the call's "
                "deadline; the request was not forwarded",
                forwarded=False,
            ) from None
        try:
            await self._write(callers)
        finally:
            self._write_lock.release()

    async def _write(self, callers: list[_Caller]) -> None:
        """Queues the request's answers and writes it, in one order for both (lock held)."""
        stream = self._open()
        sent = _Sent(callers)
        stream.pending.append(sent)
        self.requests += 1
        if sent.joined:
            self.joined += len(callers)
        data = joined_request([c.request for c in callers]) if sent.joined else callers[0].request
        try:
            await stream.call.write(data)
        except asyncio.CancelledError:
            # Cut off mid-write: whether the request left is unknown, so the pairing
            # of later responses could not be trusted. End the stream (its callers
            # hear an indeterminate failure and are sent again).
            self._end(stream, None, "a request was cut off while it was written", waiting=False)
            raise
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The stream has ended (grpc.aio raises InvalidStateError once it has): its
            # reader hands the status to the requests it carried. This one is taken back
            # (the last queued: the lock is held) and heard as indeterminate, which a
            # deduplicated publish survives by being sent again.
            if stream.pending and stream.pending[-1] is sent:
                stream.pending.pop()
            _fail(
                callers,
                lambda: SharedStreamError(
                    "UNAVAILABLE",
                    "the gateway's publish stream to the master ended while this request "
                    "was being written; it may or may not have been applied",
                ),
            )
        except (grpc.aio.UsageError, RuntimeError) as exc:
            self._end(stream, None, f"the request could not be written: {exc!r}", waiting=False)

    async def _read(self, stream: _Stream) -> None:
        """Hands each response to the callers of the oldest pending request; at the end,
        the status."""
        error: grpc.aio.AioRpcError | None = None
        try:
            async for response in stream.call:
                if not stream.pending:
                    log.error(
                        "gateway: the master at %s answered a request the shared publish "
                        "stream did not send; ending the stream",
                        self.address,
                    )
                    break
                sent = stream.pending.popleft()
                if sent.joined:
                    self._answer_joined(sent, response)
                else:
                    answer = sent.callers[0].answer
                    if not answer.done():
                        # A receipt comes first on the wire (field 1); anything else is read.
                        failed = None if response[:1] == b"\x0a" else _inline_error(response)
                        if failed is None:
                            answer.set_result(response)
                        else:
                            answer.set_exception(failed)
                self._wake_joiner()
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        finally:
            self._end(stream, error, "the stream ended without a status")

    def _answer_joined(self, sent: _Sent, response: bytes) -> None:
        """Splits a joined request's answer: each caller hears its part, as its own."""
        parsed = broker_pb2.PublishResponse.FromString(response)
        if parsed.HasField("error"):
            whole = _answered_error(parsed.error)
            self._fail_joined(sent, whole.code, whole.details, whole.trailing)
            return
        if len(parsed.parts) != len(sent.callers):
            log.error(
                "gateway: the master at %s answered a joined publish request of %d parts "
                "with %d; this link sends each publish alone from now on",
                self.address,
                len(sent.callers),
                len(parsed.parts),
            )
            self._joining = None
            _fail(
                sent.callers,
                lambda: SharedStreamError(
                    "UNKNOWN",
                    "the master's answer to the joined request that carried this publish "
                    "did not match it; it may or may not have been applied",
                ),
            )
            return
        for caller, part in zip(sent.callers, parsed.parts, strict=True):
            if caller.answer.done():
                continue
            if part.HasField("error"):
                caller.answer.set_exception(_answered_error(part.error))
            else:
                caller.answer.set_result(part.SerializeToString())

    def _fail_joined(self, sent: _Sent, code: str, details: str, trailing: _Metadata) -> None:
        """A joined request failed as a whole: each caller hears what a request of its own
        would have, except a definite refusal, which may be the joining's (too many parts
        for the master's limits): nothing was applied, so each is sent again alone, and
        the link stops joining."""
        definite = classify(code, sent=True) == "definite"
        if definite and self._joining is not None:
            log.warning(
                "gateway: the master at %s refused a joined publish request of %d parts as a "
                "whole (%s: %s); this link sends each publish alone from now on",
                self.address,
                len(sent.callers),
                code,
                details,
            )
            self._joining = None
        _fail(
            sent.callers,
            lambda: (
                SharedStreamError(
                    "UNAVAILABLE",
                    f"the master refused the joined request that carried this publish as a "
                    f"whole ({code}: {details}); nothing of it was applied, and it is sent again "
                    "alone",
                    forwarded=False,
                    collateral=True,
                )
                if definite
                else SharedStreamError(code, details, trailing)
            ),
        )

    def _end(
        self,
        stream: _Stream,
        error: grpc.aio.AioRpcError | None,
        why: str,
        *,
        waiting: bool = True,
    ) -> None:
        """Ends the stream and tells every pending caller how (module docstring); with
        `waiting`, the callers not yet written too (the stream's replica may be gone)."""
        if stream.ended:
            return
        stream.ended = True
        if self._stream is stream:
            self._stream = None
        stream.call.cancel()
        if stream.moved is not None:
            stream.moved.cancel()
        if stream.reader is not None and stream.reader is not asyncio.current_task():
            stream.reader.cancel()
        if error is not None:
            code = error.code().name
            details = error.details() or ""
            trailing: _Metadata = tuple(pairs(error.trailing_metadata()))
            # grpc/grpc#36066 (squall.wire.retry.status_lost): indeterminate, not INTERNAL.
            if status_lost(code, details):
                code, details, trailing = "UNKNOWN", "the master's status was lost in transit", ()
        else:
            code, details, trailing = "UNAVAILABLE", why, ()
        pending = list(stream.pending)
        stream.pending.clear()
        unsent = sum(not c.answer.done() for c in self._waiting) if waiting else 0
        if pending or unsent:
            log.info(
                "gateway: shared publish stream to %s ended with %s (%s); %d requests "
                "unanswered, carrying %d publishes; %d publishes not yet written",
                self.address,
                code,
                details,
                len(pending),
                sum(len(sent.callers) for sent in pending),
                unsent,
            )
        definite = error is not None and classify(code, sent=True) == "definite"
        for index, sent in enumerate(pending):
            if index == 0 and error is not None:
                if sent.joined:
                    self._fail_joined(sent, code, details, trailing)
                elif not sent.callers[0].answer.done():
                    sent.callers[0].answer.set_exception(SharedStreamError(code, details, trailing))
                continue
            _fail(
                sent.callers,
                lambda: SharedStreamError(
                    "UNAVAILABLE",
                    f"the gateway's shared publish stream to the master ended ({code}: "
                    f"{details}) before this request was answered; it may or may not have "
                    "been applied",
                    collateral=definite,
                ),
            )
        if waiting:
            # They go again through the forwarder, to the master it follows by then.
            self._fail_waiting(
                f"the gateway's shared publish stream to the master ended ({code}: {details}) "
                "before this request was written",
                collateral=definite,
            )
        else:
            self._wake_joiner()

    def _fail_waiting(self, details: str, *, collateral: bool = False) -> None:
        """Fails the callers not written yet: nothing of theirs can have been applied."""
        left = list(self._waiting)
        self._waiting.clear()
        _fail(
            left,
            lambda: SharedStreamError(
                "UNAVAILABLE", details, forwarded=False, collateral=collateral
            ),
        )

    async def close(self) -> None:
        """Ends the stream (pending and waiting callers hear UNAVAILABLE) and waits for its
        tasks."""
        if self._joiner is not None:
            self._joiner.cancel()
        stream = self._stream
        if stream is not None:
            self._end(stream, None, "the gateway is stopping")
        self._fail_waiting("the gateway is stopping; the request was not forwarded")
        tasks = [t for t in (self._joiner, stream.reader if stream else None) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)


class SharedPublishStreams:
    """The shared publish streams: one per replica and set of forwarded credentials."""

    def __init__(
        self,
        masters: MasterTracker,
        inflight_max: int,
        *,
        links_per_replica_max: int = 8,
        client_key: Callable[[int], str] = lambda n: f"gateway-publish-stream-{n}",
        joining: Joining | None = Joining(),
    ) -> None:
        self._masters = masters
        self._inflight_max = inflight_max
        self._joining = joining
        self._links_max = links_per_replica_max
        self._client_key = client_key
        self._links: dict[tuple[str, _Metadata], SharedPublishStream] = {}
        self._made = 0

    def stream(
        self, address: str, metadata: _Metadata, peer_key: str
    ) -> SharedPublishStream | None:
        """The link for these credentials to that replica (None: too many; go unary).

        `metadata` is what the call would forward, without the app's connection (under
        `peer_key`): the stream carries its own name there, so the replica's per-client
        limits count the stream as one client.
        """
        key = (address, metadata)
        link = self._links.get(key)
        if link is not None:
            return link
        if sum(1 for a, _ in self._links if a == address) >= self._links_max:
            return None
        self._made += 1
        name = self._client_key(self._made)
        link = SharedPublishStream(
            self._masters,
            address,
            (*metadata, (peer_key, name)),
            self._inflight_max,
            name,
            self._joining,
        )
        self._links[key] = link
        return link

    def backlog(self) -> Backlog:
        """Every link's backlog together (call on the gateway's loop)."""
        return sum((link.backlog() for link in self._links.values()), Backlog())

    @property
    def opened(self) -> int:
        """Streams opened by every link so far."""
        return sum(link.opened for link in self._links.values())

    async def close(self) -> None:
        """Ends every link's stream."""
        await asyncio.gather(*(link.close() for link in self._links.values()))
