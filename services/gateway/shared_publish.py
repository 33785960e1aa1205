"""One long-lived `PublishStream` per master that carries many callers' unary publishes.

A unary `Publish` forwarded as a unary call pays a new HTTP/2 stream and a new server
call on the master for every event. The gateway instead writes each deduplicated unary
publish (publisher id and a sequence on every event: `retry.publish_deduplicated`) as one
request of a `PublishStream` it keeps open to the master, shared by every caller with the
same forwarded credentials, and hands each caller the response that answers its request
(the master answers a stream's requests in order, so the n-th response answers the n-th
request written).

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

Back-pressure: at most `inflight_max` requests are unanswered on one stream (the
replica's per-client limit counts the stream as one client); more callers wait for a
slot within their attempt's time. A caller that gives up (deadline, cancellation) leaves
its slot taken until the master answers its request, so the master never holds more.
A write that is cut off (its caller cancelled in the middle) ends the stream, since the
pairing of responses to requests could no longer be trusted; the other callers retry.

When the group views move the master away from a stream's replica, the stream is
cancelled (a paused master cannot end it itself) and its callers retry at the new one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from squall.v1 import broker_pb2
from squall.wire.retry import classify
from squall_server.common.errors import INLINE_ERRORS, PUBLISH_ERRORS_KEY
from squall_server.gateway.master import Master, MasterTracker, pairs

log = logging.getLogger("squall.gateway")

PUBLISH_STREAM_PATH = "/squall.v1.Publisher/PublishStream"

_Metadata = tuple[tuple[str, str | bytes], ...]

# grpc/grpc#36066: the status a master ended the stream with, overwritten because a
# request was still being written (see forward.py): indeterminate, never INTERNAL.
_CORE_WRITE_ERROR = "Internal error from Core"


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
    error = parsed.error
    return SharedStreamError(error.code or "UNKNOWN", error.message, tuple(error.metadata.items()))


def _seen(future: asyncio.Future[bytes]) -> None:
    """Marks an answer whose caller gave up as observed (no "never retrieved" warning)."""
    if not future.cancelled():
        future.exception()


@dataclass
class _Stream:
    """One open PublishStream and the callers waiting for its responses, in write order."""

    call: grpc.aio.StreamStreamCall[bytes, bytes]
    pending: collections.deque[asyncio.Future[bytes]] = field(default_factory=collections.deque)
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
    ) -> None:
        self._masters = masters
        self.address = address
        # The master answers a failed request inline and goes on (a master that does not
        # know the key ends the stream at it instead; both are handled).
        self._metadata = (*metadata, (PUBLISH_ERRORS_KEY, INLINE_ERRORS))
        self._slots = asyncio.Semaphore(inflight_max)
        self._write_lock = asyncio.Lock()
        self._stream: _Stream | None = None
        self.name = name
        # How many streams this link has opened (1 while nothing broke one).
        self.opened = 0

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
        answer = await self.submit(request, deadline)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(answer)
        except TimeoutError:
            raise SharedStreamError(
                "DEADLINE_EXCEEDED",
                "the master did not answer the publish within the call's deadline; it may "
                "or may not have been applied",
            ) from None

    async def submit(self, request: bytes, deadline: float | None = None) -> asyncio.Future[bytes]:
        """Writes one serialized PublishRequest (waiting for a slot until `deadline`, loop
        time); returns the future of its response, which fails with a SharedStreamError."""
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
        try:
            await self._write(request, answer, deadline)
        except BaseException:
            if not answer.done():
                answer.cancel()
            raise
        return answer

    async def _write(
        self, request: bytes, answer: asyncio.Future[bytes], deadline: float | None
    ) -> None:
        """Queues the answer and writes the request, in one order for both."""
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
            stream = self._open()
            stream.pending.append(answer)
            try:
                await stream.call.write(request)
            except asyncio.CancelledError:
                # Cut off mid-write: whether the request left is unknown, so the pairing
                # of later responses could not be trusted. End the stream (its callers
                # hear an indeterminate failure and are sent again).
                self._end(stream, None, "a caller was cancelled while its request was written")
                raise
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                # The stream has ended (grpc.aio raises InvalidStateError once it has):
                # its reader hands the status to the requests it carried. This one is
                # taken back (the last queued: the lock is held) and heard as
                # indeterminate, which a deduplicated publish survives by being sent again.
                if stream.pending and stream.pending[-1] is answer:
                    stream.pending.pop()
                if not answer.done():
                    answer.set_exception(
                        SharedStreamError(
                            "UNAVAILABLE",
                            "the gateway's publish stream to the master ended while this "
                            "request was being written; it may or may not have been applied",
                        )
                    )
            except (grpc.aio.UsageError, RuntimeError) as exc:
                self._end(stream, None, f"the request could not be written: {exc!r}")
        finally:
            self._write_lock.release()

    async def _read(self, stream: _Stream) -> None:
        """Hands each response to the oldest pending caller; at the end, the status."""
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
                answer = stream.pending.popleft()
                if answer.done():
                    continue
                # A receipt comes first on the wire (field 1); anything else is read.
                failed = None if response[:1] == b"\x0a" else _inline_error(response)
                if failed is None:
                    answer.set_result(response)
                else:
                    answer.set_exception(failed)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        finally:
            self._end(stream, error, "the stream ended without a status")

    def _end(self, stream: _Stream, error: grpc.aio.AioRpcError | None, why: str) -> None:
        """Ends the stream and tells every pending caller how (module docstring)."""
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
            if code == "INTERNAL" and details == _CORE_WRITE_ERROR:
                code, details, trailing = "UNKNOWN", "the master's status was lost in transit", ()
        else:
            code, details, trailing = "UNAVAILABLE", why, ()
        pending = list(stream.pending)
        stream.pending.clear()
        if pending:
            log.info(
                "gateway: shared publish stream to %s ended with %s (%s); %d requests unanswered",
                self.address,
                code,
                details,
                len(pending),
            )
        definite = error is not None and classify(code, sent=True) == "definite"
        for index, answer in enumerate(pending):
            if answer.done():
                continue
            if index == 0 and error is not None:
                answer.set_exception(SharedStreamError(code, details, trailing))
            else:
                answer.set_exception(
                    SharedStreamError(
                        "UNAVAILABLE",
                        f"the gateway's shared publish stream to the master ended ({code}: "
                        f"{details}) before this request was answered; it may or may not "
                        "have been applied",
                        collateral=definite,
                    )
                )

    async def close(self) -> None:
        """Ends the stream (pending callers hear UNAVAILABLE) and waits for its reader."""
        stream = self._stream
        if stream is None:
            return
        self._end(stream, None, "the gateway is stopping")
        if stream.reader is not None:
            await asyncio.gather(stream.reader, return_exceptions=True)


class SharedPublishStreams:
    """The shared publish streams: one per replica and set of forwarded credentials."""

    def __init__(
        self,
        masters: MasterTracker,
        inflight_max: int,
        *,
        links_per_replica_max: int = 8,
        client_key: Callable[[int], str] = lambda n: f"gateway-publish-stream-{n}",
    ) -> None:
        self._masters = masters
        self._inflight_max = inflight_max
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
            self._masters, address, (*metadata, (peer_key, name)), self._inflight_max, name
        )
        self._links[key] = link
        return link

    @property
    def opened(self) -> int:
        """Streams opened by every link so far."""
        return sum(link.opened for link in self._links.values())

    async def close(self) -> None:
        """Ends every link's stream."""
        await asyncio.gather(*(link.close() for link in self._links.values()))
