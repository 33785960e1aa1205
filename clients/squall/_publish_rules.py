"""The publisher's rules that are not I/O, shared by the threaded and the asyncio publisher.

`squall._publisher.Publisher` (threads) and `squall.aio.Publisher` (asyncio) differ only
in how they wait and send; what they decide is here, once: validating a publisher's
arguments, turning app events into a `PublishRequest` with consecutive sequences,
checking that a response answers the oldest unanswered batch, the errors a broken stream
leaves its batches with, marking the first receipt after a move, and the retry of one
indeterminate batch (`RetryRun`: which failures are retried, the time budget, the
backoff, a redirect's retry without one, and the final `Indeterminate`). See the module
docstring of `squall._publisher` for the behaviour these rules add up to.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import grpc
import tenacity

from squall._errors import Indeterminate, PublisherLost, SquallError, Unavailable, error_for
from squall._proxy import (
    MASTER_ADDRESS_KEY,
    STATUS_LOST_KEY,
    Binding,
    Endpoint,
    RebindCallback,
)
from squall._types import Receipt, receipt_count
from squall.v1 import broker_pb2, common_pb2
from squall.wire.retry import Outcome, RetryPolicy, overall, status_lost

# What publish_many accepts per event: a payload, a (key, payload) or (key, payload,
# headers) tuple, or any object with `payload` (and optionally `key`, `headers`)
# attributes, such as common_pb2.EventData or squall.Message.
EventLike = bytes | tuple[bytes | None, bytes] | tuple[bytes | None, bytes, Mapping[str, str]] | Any

INFLIGHT_BATCHES_MAX_DEFAULT = 8
# A call that has sent nothing moves to a fresh stream at most this many times (within the
# retry policy's time budget) when the streams it waits on die for other callers' batches:
# a loop bound, far above the streams that die in one outage.
UNSENT_STREAM_MOVES_MAX = 100
# A publisher proxy waiting this long for a receipt starts asking the gateway who the master
# is: a master that hangs after the group elected another cannot end its streams, and the
# receipt would otherwise be waited for until the publisher's timeout. A healthy receipt
# takes milliseconds; a failover about 0.3-0.5 s (bench/README.md, fault gaps).
RECEIPT_STALL_AFTER_S = 0.3
# ...then asks again this often, each check with this deadline: the gateway forwards the
# question to the master it knows, so until its view changes a check reaches the hung one
# and must give up soon, and the first check after the view changes finds the new master.
RECEIPT_STALL_CHECK_S = 0.1
BATCH_EVENTS_DEFAULT = 500
# A batch is one gRPC message; with 100-byte events 10,000 is ~1.3 MB, far under the
# 64 MiB message limit, and keeps one response's conversion short.
BATCH_EVENTS_MAX = 10_000
# Bounds of inflight_batches_max (batches unanswered on one stream at a time).
INFLIGHT_BATCHES_BOUNDS = (1, 1024)

log = logging.getLogger("squall")


def new_publisher_id() -> str:
    """A fresh random publisher id."""
    return f"py-{uuid.uuid4().hex}"


class NotSent(Unavailable):
    """An attempt that never left the client: nothing was applied, so retrying is safe."""


def check_publisher_args(
    publisher_id: str, start_sequence: int, inflight_batches_max: int, timeout_s: float
) -> None:
    """Raises ValueError naming the first bad constructor argument of a publisher."""
    if not publisher_id:
        raise ValueError("publisher_id must not be empty")
    if start_sequence < 1:
        raise ValueError(
            f"start_sequence must be >= 1 (0 disables deduplication), not {start_sequence}"
        )
    low, high = INFLIGHT_BATCHES_BOUNDS
    if not low <= inflight_batches_max <= high:
        raise ValueError(f"inflight_batches_max must be {low}..{high}, not {inflight_batches_max}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, not {timeout_s}")


def check_batch_events(batch_events: int) -> None:
    """Raises ValueError unless 1 <= batch_events <= BATCH_EVENTS_MAX."""
    if not 1 <= batch_events <= BATCH_EVENTS_MAX:
        raise ValueError(f"batch_events must be 1..{BATCH_EVENTS_MAX}, not {batch_events}")


def new_request(
    topic: str, publisher_id: str, session_token: str = ""
) -> broker_pb2.PublishRequest:
    """An empty publish request for this publisher, asking for compact receipts."""
    return broker_pb2.PublishRequest(
        topic=topic,
        publisher_id=publisher_id,
        session_token=session_token,
        compact_receipts=True,
    )


def new_session_token(publisher_id: str) -> str:
    """The token of a new stream: it marks where per-publisher ordering may change."""
    return f"{publisher_id}/{uuid.uuid4().hex[:12]}"


def copy_for_retry(
    request: broker_pb2.PublishRequest, session_token: str
) -> broker_pb2.PublishRequest:
    """A copy of a batch (same events and sequences) under a fresh stream's token."""
    again = broker_pb2.PublishRequest()
    again.CopyFrom(request)
    again.session_token = session_token
    return again


def add_events(
    request: broker_pb2.PublishRequest, events: Sequence[Any], first_sequence: int
) -> None:
    """Appends events to a request with consecutive sequences.

    The homogeneous cases are list comprehensions over `events.add` (half the cost of
    building EventData objects and copying them in); mixed input takes the general path.
    """
    add = request.events.add
    sequences = itertools.count(first_sequence)
    kinds = set(map(type, events))
    if kinds == {bytes}:
        [add(payload=p, sequence=s) for p, s in zip(events, sequences, strict=False)]
    elif kinds == {tuple} and all(len(e) == 2 for e in events):
        [add(key=k, payload=p, sequence=s) for (k, p), s in zip(events, sequences, strict=False)]
    else:
        for event, sequence in zip(events, sequences, strict=False):
            _add_one(add, event, sequence)


def _add_one(add: Callable[..., common_pb2.EventData], event: Any, sequence: int) -> None:
    if isinstance(event, bytes | bytearray | memoryview):
        add(payload=bytes(event), sequence=sequence)
    elif isinstance(event, tuple | list):
        if len(event) == 2:
            add(key=event[0], payload=event[1], sequence=sequence)
        elif len(event) == 3:
            add(key=event[0], payload=event[1], headers=event[2], sequence=sequence)
        else:
            raise TypeError(f"an event tuple is (key, payload[, headers]), not {len(event)} items")
    elif hasattr(event, "payload"):
        add(
            key=getattr(event, "key", None) or b"",
            payload=event.payload,
            headers=getattr(event, "headers", None) or None,
            sequence=sequence,
            cost=getattr(event, "cost", 0) or 0,
        )
    else:
        raise TypeError(
            f"cannot publish {type(event).__name__}: give bytes, (key, payload) or an event"
        )


def response_mismatch(
    request_id: int | None, count: int, response: broker_pb2.PublishResponse
) -> Indeterminate | None:
    """The protocol error when a response does not answer the oldest unanswered batch.

    `request_id` is None when nothing is unanswered. Responses come in request order (the
    proto's contract), so anything else means the stream can no longer be trusted.
    """
    if (
        request_id is not None
        and request_id == response.request_id
        and count == receipt_count(response)
    ):
        return None
    return Indeterminate(
        f"protocol error: answer to request {response.request_id} with "
        f"{receipt_count(response)} receipts does not match the oldest batch",
        grpc.StatusCode.INTERNAL,
    )


def stream_end_errors(
    code: grpc.StatusCode, details: str, abort_error: SquallError | None
) -> tuple[SquallError, SquallError]:
    """What the oldest unanswered batch of an ended stream gets, and what the others get.

    The oldest gets the stream's status (so a bad event fails with `InvalidArgument`);
    every later one was sent and may have been applied, so it is indeterminate. A stream
    the client abandoned (`abort_error`) gives that reason to all of them.
    """
    if abort_error is not None:
        return abort_error, abort_error
    first = error_for(code, details, sent=True)
    rest = (
        first
        if isinstance(first, Indeterminate)
        else Indeterminate(
            f"the stream ended after an earlier batch failed: {details}",
            grpc.StatusCode.CANCELLED,
        )
    )
    return first, rest


class AbandonableStream(Protocol):
    """A threaded publish stream as its abandoning sees it."""

    dead: bool
    abort_error: SquallError | None
    call: Any


def abandon_stream(stream: AbandonableStream, code: grpc.StatusCode, details: str) -> None:
    """Cancels a live stream's call once, leaving the reader the reason to report: its
    unanswered batches become indeterminate with it (the caller holds the stream's lock)."""
    if stream.dead or stream.abort_error is not None:
        return
    stream.abort_error = Indeterminate(details, code)
    stream.call.cancel()


def not_sent_error(details: str) -> NotSent:
    """The error of buffered events a broken stream never sent (safe to retry)."""
    return NotSent(f"not sent: the publish stream ended ({details})", grpc.StatusCode.CANCELLED)


class WatchedStream(Protocol):
    """What a proxy stream's stall watchdog reads and sets (a publisher's own stream, or
    a client's shared stream to a replica)."""

    dead: bool
    pending: Any  # a deque of what was sent, each with its `sent_at` (time.monotonic)
    woken: Any  # a threading.Event: a request sent while none was pending, or the end
    abort_error: SquallError | None
    moved_to: str


def watch_stalls(
    stream: WatchedStream,
    lock: AbstractContextManager[Any],
    endpoint: Endpoint,
    check_master: Callable[[float], str],
    publisher_id: str,
    abort: Callable[[Any, grpc.StatusCode, str], None],
) -> None:
    """A proxy stream's stall watchdog (run in a thread of its own): once the oldest
    unanswered request is RECEIPT_STALL_AFTER_S old, asks every RECEIPT_STALL_CHECK_S who
    the master is (`check_master`) and abandons the stream (`abort`, under `lock`) as soon
    as the gateway names another replica, recording it in `moved_to`. Ends with the stream
    (whoever sets `dead` sets `woken`)."""
    while not stream.dead:
        stream.woken.clear()
        with lock:
            oldest = stream.pending[0] if stream.pending else None
        if oldest is None:
            stream.woken.wait()
            continue
        late_in_s = oldest.sent_at + RECEIPT_STALL_AFTER_S - time.monotonic()
        if late_in_s > 0:
            stream.woken.wait(late_in_s)
            continue
        checked = check_master(RECEIPT_STALL_CHECK_S)
        with lock:
            still_waiting = not stream.dead and bool(stream.pending) and stream.pending[0] is oldest
            master = stall_move(publisher_id, endpoint, checked) if still_waiting else ""
            if master:
                if stream.abort_error is None:
                    stream.moved_to = master
                abort(stream, grpc.StatusCode.UNAVAILABLE, stall_details(endpoint, master))
                return
        if still_waiting:
            # On the wake event, not a sleep: the thread ends as soon as its stream does.
            stream.woken.wait(RECEIPT_STALL_CHECK_S)


def stall_move(publisher_id: str, endpoint: Endpoint, master: str) -> str:
    """Where a proxy's stream whose receipt is late moves, given the master the gateway
    named ("" if it could not say): that master when it is another replica, else "" (keep
    waiting). A move is logged; the stream is then abandoned with `stall_details`."""
    if not master or master == endpoint.address:
        return ""
    log.info(
        "publisher %s: no receipt from %s (%s) and the master is now %s: resending there",
        publisher_id,
        endpoint.node_id,
        endpoint.address,
        master,
    )
    return master


def stall_details(endpoint: Endpoint, master: str) -> str:
    """Why a stream was abandoned after a late receipt (see `stall_move`)."""
    return f"no receipt from {endpoint.address}, and the master is now {master}"


STATUS_LOST_TRAILING = ((STATUS_LOST_KEY, "1"),)


def status_lost_trailing(code: grpc.StatusCode, details: str, trailing: Any) -> Any:
    """The trailing metadata an asyncio reader hands the binding for a stream that ended
    with `code` and `details`: STATUS_LOST_TRAILING when grpc.aio lost the real status
    (the replica ended the stream, so it is up, and the proxy tries it again rather than
    moving on as from a replica that may be gone), else `trailing`."""
    if status_lost(code.name, details):
        return STATUS_LOST_TRAILING
    return trailing


def moved_trailing(moved_to: str) -> tuple[tuple[str, str], ...] | None:
    """The trailing metadata a stream abandoned for `moved_to` is treated as having: a
    slave's redirect there, which a replicated proxy follows at once (None: no move)."""
    return ((MASTER_ADDRESS_KEY, moved_to),) if moved_to else None


def mark_rebound(receipts: list[Receipt]) -> None:
    """Flags the first receipt after a move to another replica (`Receipt.rebound`)."""
    if receipts:
        receipts[0] = dataclasses.replace(receipts[0], rebound=True)


def outcome(error: SquallError) -> Outcome:
    """The outcome of one failed attempt: indeterminate if the events may have been stored."""
    return "indeterminate" if error.maybe_stored else "definite"


def worth_retrying(error: BaseException, closed: bool) -> bool:
    """Only indeterminate or unsent attempts are repeated, and not once the publisher closed."""
    return isinstance(error, Indeterminate | NotSent) and not closed


class RetryRun:
    """The retry of one batch after its first attempt failed: budget, backoff, final error.

    A driver (the threaded publisher with `tenacity.Retrying`, the asyncio one with
    `tenacity.AsyncRetrying`) calls `begin()`, then runs tenacity with `tenacity_args()`,
    raising `first` as attempt 1 (it was already made) and calling `failed()` for every
    later attempt's error; when tenacity gives up it raises `final(error)`.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        binding: Binding,
        first: SquallError,
        *,
        monotonic: Callable[[], float],
        closed: Callable[[], bool],
        publisher_id: str,
    ) -> None:
        self.first = first
        self._policy = policy
        self._binding = binding
        self._monotonic = monotonic
        self._closed = closed
        self._publisher_id = publisher_id
        self.outcomes: list[Outcome] = [outcome(first)]
        # The latest attempt that may have stored the events, for the final error's code.
        self.maybe: SquallError | None = first if first.maybe_stored else None
        self._started = 0.0
        self._backoff = tenacity.wait_random_exponential(
            multiplier=policy.backoff_initial_ms / 1000, max=policy.backoff_max_ms / 1000
        )

    def worth_retrying(self, error: BaseException) -> bool:
        """Whether an attempt that failed with `error` is repeated."""
        return worth_retrying(error, self._closed())

    def begin(self) -> None:
        """Raises at once when there is nothing to retry; starts the time budget otherwise.

        A lost non-replicated binding raises `PublisherLost`; a policy without retries or
        a definite first failure raises `first`.
        """
        lost = self._binding.lost_error(self.first)
        if lost is not None:
            raise lost
        if not self._policy.retries or not self.worth_retrying(self.first):
            raise self.first
        self._started = self._monotonic()

    def _spent(self, state: tenacity.RetryCallState) -> bool:
        # The attempt already made counts; the budget is the time since it failed.
        elapsed_ms = (self._monotonic() - self._started) * 1000
        return self._policy.exhausted(state.attempt_number, elapsed_ms)

    def _wait_s(self, state: tenacity.RetryCallState) -> float:
        # A slave's redirect names a master that can take the batch now.
        return 0.0 if self._binding.take_redirect() else float(self._backoff(state))

    def tenacity_args(self) -> dict[str, Any]:
        """stop, wait, retry and reraise for tenacity.Retrying / AsyncRetrying."""
        return {
            "stop": self._spent,
            "wait": self._wait_s,
            "retry": tenacity.retry_if_exception(self.worth_retrying),
            "reraise": True,
        }

    def failed(self, error: SquallError, request: broker_pb2.PublishRequest, attempt: int) -> None:
        """Records a retry's failure; raises `PublisherLost` once the binding is lost."""
        lost = self._binding.lost_error(error)
        if lost is not None:
            # The master went during the retries: say so, with what any attempt may
            # have stored.
            raise PublisherLost(
                lost.details,
                lost.code,
                maybe_stored=self.maybe is not None or error.maybe_stored,
            ) from error
        self.outcomes.append(outcome(error))
        self.maybe = error if error.maybe_stored else self.maybe
        log.debug(
            "publisher %s: retry %d of sequences from %d failed: %s",
            self._publisher_id,
            attempt - 1,
            request.events[0].sequence if request.events else 0,
            error,
        )

    def final(self, error: SquallError) -> SquallError:
        """The error the app sees once retrying stopped at `error`.

        `Indeterminate` when any attempt may have stored the events, even if the last one
        failed definitely (`squall.wire.retry.overall`); otherwise `error` itself.
        """
        if isinstance(error, PublisherLost | Indeterminate):
            return error
        if overall(self.outcomes) != "indeterminate":
            return error
        return Indeterminate(
            f"{error.details} (after {len(self.outcomes)} attempts; an earlier attempt "
            "may have stored the events)",
            self.maybe.code if self.maybe is not None else grpc.StatusCode.UNKNOWN,
        )


class Moves:
    """Which replica a publisher's receipts come from, and its moves to another one."""

    def __init__(self, publisher_id: str, on_rebind: RebindCallback | None) -> None:
        self._publisher_id = publisher_id
        self._on_rebind = on_rebind
        self.endpoint: Endpoint | None = None  # the replica whose stream last answered
        self.count = 0  # moves so far

    def answered(self, endpoint: Endpoint | None) -> Endpoint | None:
        """A stream to `endpoint` answered for the first time: the previous replica if
        this is a move, else None."""
        previous = self.endpoint
        if endpoint is None:
            return None
        self.endpoint = endpoint
        if previous is None or previous.address == endpoint.address:
            return None
        self.count += 1
        return previous

    def report(self, old: Endpoint, new: Endpoint) -> None:
        """Tells the app its publisher moved (before it sees the receipt flagged rebound)."""
        log.info(
            "publisher %s moved from %s (%s) to %s (%s): order may change here",
            self._publisher_id,
            old.node_id,
            old.address,
            new.node_id,
            new.address,
        )
        if self._on_rebind is None:
            return
        try:
            self._on_rebind(old, new)
        except Exception:
            # The app's callback must not break the receipts of its own publishes.
            log.exception("publisher %s: on_rebind callback failed", self._publisher_id)
