"""Joining lone publishes of many publishers into shared requests, and splitting the answers.

The pure part of a client's shared publish stream, used by the threaded one
(`squall._publish_mux`) and the asyncio one (`squall.aio._publish_mux`): which waiting
events go out together, the request that carries them (one part per publisher id and
topic in `PublishRequest.parts` when there are several), and how each answer — a
response, a response with parts, an error answered inline, the stream's end — resolves
the callers' futures. No threads, no event loop and no clock here: the drivers wait,
send and read.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Generic, Protocol, TypeVar

import grpc

from squall._errors import Indeterminate, SquallError, error_for
from squall._proxy import master_address
from squall._publish_rules import (
    BATCH_EVENTS_DEFAULT,
    NotSent,
    new_request,
    stream_end_errors,
)
from squall._types import Receipt, receipts_from_pb
from squall.v1 import broker_pb2, common_pb2
from squall.wire import stages as _stages

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
MASTER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})

Trailing = tuple[tuple[str, str], ...]
# How a caller's attempt ended its binding to the stream's replica (a status and the
# trailing metadata), as a stream of the caller's own would have ended.
Ended = tuple[grpc.StatusCode, Trailing | None]


class JoinRefused(NotSent):
    """A joined request (or part) was refused as a whole: nothing of it was stored, and the
    caller sends its event again alone, to learn whether the refusal was its own."""


class ReceiptFuture(Protocol):
    """What joining needs of a caller's future: a threaded or an asyncio one."""

    def done(self) -> bool: ...

    def set_result(self, result: Receipt, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


F = TypeVar("F", bound=ReceiptFuture)


@dataclasses.dataclass(eq=False)
class Entry(Generic[F]):
    """One event of one publisher, waiting or sent."""

    topic: str
    publisher_id: str
    event: common_pb2.EventData
    future: F
    alone: bool
    size: int
    # The mux it was queued on, and the stream it was sent on (set when sent), so a caller
    # that times out abandons it.
    mux: Any = None
    stream: Any = None
    # Set when it failed with its stream's end (or an answer saying the stream's replica
    # is no longer master): the status and trailing metadata a publisher proxy's binding
    # is told, as a stream of its own would tell it (`ProxyBinding.stream_failed`).
    ended: Ended | None = None


def new_entry(
    topic: str,
    publisher_id: str,
    event: common_pb2.EventData,
    future: F,
    alone: bool,
    mux: Any = None,
) -> Entry[F]:
    size = len(event.payload) + len(event.key)
    return Entry(topic, publisher_id, event, future, alone, size, mux)


@dataclasses.dataclass(eq=False)
class Sent(Generic[F]):
    """One request on the stream: its parts (one per publisher and topic), in order."""

    request_id: int
    groups: list[list[Entry[F]]]
    joined: bool  # sent with PublishRequest.parts
    # When it was queued (time.monotonic; 0 when nothing watches for stalls).
    sent_at: float = 0.0


def take_next(waiting: collections.deque[Entry[F]], joins: bool) -> list[Entry[F]]:
    """The events of the next request (`waiting` is not empty): the oldest, and when it
    and joining allow, those behind it up to JOIN_EVENTS_MAX and JOIN_BYTES_MAX."""
    take = [waiting.popleft()]
    if take[0].alone or not joins:
        return take
    events, size = 1, take[0].size
    while waiting and not waiting[0].alone:
        nxt = waiting[0]
        if events >= JOIN_EVENTS_MAX or size + nxt.size > JOIN_BYTES_MAX:
            break
        take.append(waiting.popleft())
        events += 1
        size += nxt.size
    return take


def build_request(
    entries: list[Entry[F]], token: str, request_id: int, stream: Any, sent_at: float = 0.0
) -> tuple[broker_pb2.PublishRequest, Sent[F]]:
    """The request carrying `entries` (grouped per publisher and topic, in call order), and
    its record for matching the answer; each entry is marked as sent on `stream`."""
    if len(entries) == 1:
        # A lone publish (the common case): one part, no grouping.
        entries[0].stream = stream
        request = _part(entries, token)
        request.request_id = request_id
        return request, Sent(request_id, [entries], joined=False, sent_at=sent_at)
    by_publisher: dict[tuple[str, str], list[Entry[F]]] = {}
    for entry in entries:
        by_publisher.setdefault((entry.topic, entry.publisher_id), []).append(entry)
        entry.stream = stream
    groups = list(by_publisher.values())
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
    return request, Sent(request_id, groups, joined=len(groups) > 1, sent_at=sent_at)


def answers(sent: Sent[Any], response: broker_pb2.PublishResponse) -> bool:
    """Whether a response answers the oldest unanswered request: its id, or no id on a
    failure answered inline (the master answers those in order without echoing it)."""
    if response.request_id == sent.request_id:
        return True
    return response.request_id == 0 and response.HasField("error")


def mismatch_error(response: broker_pb2.PublishResponse) -> Indeterminate:
    return Indeterminate(
        f"protocol error: answer to request {response.request_id} does "
        "not match the oldest unanswered one",
        grpc.StatusCode.INTERNAL,
    )


def refuses_parts(sent: Sent[Any], response: broker_pb2.PublishResponse) -> bool:
    """Whether the answer says the server knows no parts: a joined request refused whole
    as invalid, nothing stored (join no more; each event goes again alone)."""
    if not (sent.joined and response.HasField("error")):
        return False
    error = inline_error(response.error)
    return not error.maybe_stored and error.code == grpc.StatusCode.INVALID_ARGUMENT


def settle(sent: Sent[Any], response: broker_pb2.PublishResponse) -> str | None:
    """Resolves the futures of one answered request. Not None if the stream's master is
    gone: then the master a slave's redirect names, or "" (test with `is not None`)."""
    if response.HasField("error"):
        error = inline_error(response.error)
        ended = _ended(error, response.error)
        for group in sent.groups:
            fail_group(group, error, many=sent.joined, ended=ended)
        return _gone(ended)
    if not sent.joined:
        return _answer(sent.groups[0], response)
    if len(response.parts) != len(sent.groups):
        error = Indeterminate(
            f"protocol error: {len(response.parts)} answers to {len(sent.groups)} parts",
            grpc.StatusCode.INTERNAL,
        )
        for group in sent.groups:
            fail_group(group, error, many=False)
        return ""
    gone: str | None = None
    for group, answer in zip(sent.groups, response.parts, strict=True):
        part_gone = _answer(group, answer)
        if part_gone is not None and not gone:
            gone = part_gone
    return gone


def fail_ended(
    pending: list[Sent[Any]],
    code: grpc.StatusCode,
    details: str,
    abort_error: SquallError | None,
    ended: Ended | None = None,
) -> None:
    """Fails the requests an ended stream left unanswered: the oldest gets the stream's
    status, the others are indeterminate (or all get the reason it was abandoned for);
    each caller keeps how the stream ended (`Entry.ended`)."""
    first, rest = stream_end_errors(code, details, abort_error)
    for index, sent in enumerate(pending):
        error = first if index == 0 else rest
        for group in sent.groups:
            fail_group(group, error, many=sent.joined, ended=ended)


def request_key(request: broker_pb2.PublishRequest) -> str:
    """A request's key in the latency budget's stage marks (squall.wire.stages): its
    first publisher's id and first sequence, as a publisher's own stream marks it."""
    first = request.parts[0] if request.parts else request
    sequence = first.events[0].sequence if first.events else 0
    return _stages.request_key(first.publisher_id, sequence)


def entry_key(entry: Entry[Any]) -> str:
    return _stages.request_key(entry.publisher_id, entry.event.sequence)


def inline_error(error: broker_pb2.PublishError) -> SquallError:
    """The error a request answered inline would have ended the stream with."""
    code = getattr(grpc.StatusCode, error.code or "UNKNOWN", grpc.StatusCode.UNKNOWN)
    return error_for(code, error.message or code.name.lower(), sent=True)


def fail_group(
    group: list[Entry[Any]], error: SquallError, *, many: bool, ended: Ended | None = None
) -> None:
    """Fails one part's callers. A definite refusal of several events at once (or of a
    joined request) is not theirs to keep: each is sent again alone (`JoinRefused`)."""
    if (len(group) > 1 or many) and not error.maybe_stored and not isinstance(error, NotSent):
        error = JoinRefused(f"refused with others, to be sent alone: {error.details}", error.code)
    for entry in group:
        if not entry.future.done():
            entry.ended = ended
            entry.future.set_exception(error)


def plain(metadata: Any) -> Trailing:
    """Trailing metadata as (key, str) pairs."""
    return tuple(
        (key, value.decode() if isinstance(value, bytes) else value)
        for key, value in metadata or ()
    )


def _ended(error: SquallError, answer: broker_pb2.PublishError) -> Ended | None:
    """How an error answered inline ends its callers' binding to the stream's replica: as
    the stream would have ended, with the metadata (a slave's `squall-master-address`), if
    it says the replica is no longer master; else None (the caller's own refusal)."""
    if error.code not in MASTER_GONE:
        return None
    return error.code, tuple(sorted(answer.metadata.items()))


def _gone(ended: Ended | None) -> str | None:
    """None unless the master is gone; then the master a redirect names, or ""."""
    return None if ended is None else master_address(ended[1])


def _part(group: list[Entry[Any]], token: str) -> broker_pb2.PublishRequest:
    """One publisher's events of a request, in call order."""
    request = new_request(group[0].topic, group[0].publisher_id, token)
    if len(group) == 1:
        request.events.append(group[0].event)
    else:
        request.events.extend(entry.event for entry in group)
    return request


def _answer(group: list[Entry[Any]], response: broker_pb2.PublishResponse) -> str | None:
    """Hands one part's receipts to its callers; not None if it failed as the master gone
    (the master a slave's redirect names, or "")."""
    if response.HasField("error"):
        error = inline_error(response.error)
        ended = _ended(error, response.error)
        fail_group(group, error, many=False, ended=ended)
        return _gone(ended)
    receipts = receipts_from_pb(response)
    if len(receipts) != len(group):
        error = Indeterminate(
            f"protocol error: {len(receipts)} receipts for {len(group)} events",
            grpc.StatusCode.INTERNAL,
        )
        fail_group(group, error, many=False)
        return ""
    for entry, receipt in zip(group, receipts, strict=True):
        # (An asyncio caller's future is cancelled when its task was.)
        if not entry.future.done():
            entry.future.set_result(receipt)
    return None
