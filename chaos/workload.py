"""The chaos workload: publishers and subscribers on the Squall library, every step recorded.

Publishers (``pub-N``) cycle through the ways an app can publish, so a run covers each:

=====  ==================  ===========================================================
 N     path                publishing
=====  ==================  ===========================================================
 1     gateway             idempotent: a library `Publisher` (publisher id + sequence)
 2     replicated          idempotent, through a replicated proxy (GetPublisher)
 3     non_replicated      idempotent, through a non-replicated proxy
                           (GetNonReplicatedPublisher); a new proxy after each failure
 4     gateway             not idempotent: unary `Publish`, no publisher id, no sequence
 5     gateway_unary       idempotent unary `Publish` calls (publisher id + sequence), one
                           event each, a batch's calls at once (each its own operation):
                           the gateway carries them on its shared stream to the master,
                           joined into one request when they meet
=====  ==================  ===========================================================

and again from 6. Each publish is one batch of 1..`batch_events_max` events whose values
are unique strings naming the publisher and a counter ("pub-3:17"), recorded as an
``invoke`` and then one ``complete``: "ok" with the receipts' offsets, "fail" only when the
library says the events were certainly not stored (a definite status, or nothing sent),
"indeterminate" for everything else (the library's `Indeterminate`, a `PublisherLost` that
may have stored, any error we cannot classify, or an operation still running when the
workload stopped). After an indeterminate publish an idempotent publisher sends the same
events with the same sequences again (a new operation), so the master's deduplication is
exercised; a non-idempotent one moves on. Publishers wait for each receipt before the
next publish (so "publish order" is real-time order), back off after errors (bounded,
jittered), rotate gateways and ask for a fresh proxy.

Subscribers: ``sub-N`` holds a durable streaming subscription to every topic (from the
earliest offset; it acks each batch, so a reconnect redelivers from the cursor), and
``push-N`` a push subscriber (`PushEndpoint` on the target's host address, ordered,
retry forever) on every topic. Every batch received is a ``deliver`` record; each
subscription is an ``invoke``/``complete`` with op "subscribe". At the end the workload
lists each topic's push subscribers (op "list_push_subscribers"), so the checker knows
whether the cluster removed one.

The library is synchronous; every publisher and subscriber runs in its own daemon thread
and the async API only starts, waits and stops them, so `stop` returns within its drain
timeout even when a call hangs on a broken cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

import squall
from chaos.history import HistoryWriter
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2

log = logging.getLogger("chaos.workload")

_T = TypeVar("_T")

# (path, idempotent) of publisher N, cycling.
PUBLISHER_KINDS: tuple[tuple[str, bool], ...] = (
    ("gateway", True),
    ("replicated", True),
    ("non_replicated", True),
    ("gateway", False),
    ("gateway_unary", True),
)
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 1.0
# How long stop() lets a publisher finish the call it is in before it moves on.
PUBLISHER_JOIN_S_MAX = 10.0
CLOSE_WAIT_S = 2.0
ACK_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Target:
    """Where the workload connects."""

    gateway_addresses: list[str]
    """host:port of every gateway."""
    host_address: str
    """The IP push endpoints listen on; the nodes must be able to reach it."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, squall.SquallError):
        return f"{exc.code.name}: {exc.details}"
    if isinstance(exc, grpc.RpcError):
        code, details = _rpc_status(exc)
        return f"{code.name}: {details}"
    return f"{type(exc).__name__}: {exc}"


def _rpc_status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return code, str(details or code.name)


def classify_publish_error(exc: BaseException) -> str:
    """ "fail" only when the events were certainly not stored, else "indeterminate".

    The library keeps the three outcomes apart: `maybe_stored` is True for Indeterminate
    and for a PublisherLost whose batch was in flight; any other SquallError is a definite
    answer (or nothing was sent). A raw RpcError from a unary publish that was sent is
    classified by the library's rule. Anything else (a bug, a closed channel) may have
    happened after the request left, so it is indeterminate.
    """
    if isinstance(exc, squall.SquallError):
        return "indeterminate" if exc.maybe_stored else "fail"
    if isinstance(exc, grpc.RpcError):
        code, _ = _rpc_status(exc)
        return "indeterminate" if squall.classify(code, sent=True) == "indeterminate" else "fail"
    return "indeterminate"


class _Recorder:
    """Writes the workload's records; after close() nothing more is written.

    Every invoke gets exactly one complete: the operation's own, or "indeterminate" from
    close() for one still running when the workload stopped.
    """

    def __init__(self, history: HistoryWriter) -> None:
        self._history = history
        self._lock = threading.Lock()
        self._open: dict[int, str] = {}
        self._closed = False

    def invoke(self, **fields: Any) -> int:
        op_id = self._history.new_op_id()
        with self._lock:
            if self._closed:
                raise _Stopped()
            self._open[op_id] = str(fields.get("process"))
            self._history.write("invoke", id=op_id, **fields)
        return op_id

    def complete(
        self,
        op_id: int,
        outcome: str,
        error: str | None = None,
        offsets: Sequence[int] = (),
        **fields: Any,
    ) -> None:
        with self._lock:
            if self._open.pop(op_id, None) is None:
                return  # already closed as indeterminate by stop()
            self._history.write(
                "complete", id=op_id, outcome=outcome, error=error, offsets=list(offsets), **fields
            )

    def deliver(self, **fields: Any) -> None:
        with self._lock:
            if not self._closed:
                self._history.write("deliver", **fields)

    def close(self) -> int:
        """Completes every open operation as indeterminate; returns how many there were."""
        with self._lock:
            self._closed = True
            still_open = sorted(self._open)
            for op_id in still_open:
                self._history.write(
                    "complete",
                    id=op_id,
                    outcome="indeterminate",
                    error="still running when the workload stopped",
                    offsets=[],
                )
            self._open.clear()
            return len(still_open)


class _Stopped(Exception):
    """The workload is stopping; the thread ends."""


@dataclass
class _Gateways:
    """One thread's clients, one per gateway, and the one in use (rotated on failure)."""

    addresses: list[str]
    index: int
    timeout_s: float
    retry_total_ms: int
    clients: dict[str, squall.Client] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> squall.Client:
        address = self.addresses[self.index % len(self.addresses)]
        with self.lock:
            client = self.clients.get(address)
            if client is None:
                client = self.clients[address] = squall.connect(
                    address,
                    timeout_s=self.timeout_s,
                    # The budget is time, as an app's is by default (no attempt cap).
                    retry_backoff_initial_ms=50,
                    retry_backoff_max_ms=250,
                    retry_total_ms_max=self.retry_total_ms,
                )
            return client

    def rotate(self) -> None:
        self.index += 1

    def close(self) -> None:
        with self.lock:
            clients = list(self.clients.values())
            self.clients.clear()
        for client in clients:
            try:
                client.close()
            except Exception:  # closing a broken client must not stop the others closing
                log.debug("closing a client failed", exc_info=True)


def _topic(client: squall.Client, name: str) -> squall.Topic:
    # A handle without a RetrieveTopic call: only the name is used, and a publisher or
    # subscriber must not need the cluster to answer before it can even try.
    return squall.Topic(client, squall.TopicInfo(name, "replicated", 0, 0, 0))


class _Worker:
    """One thread of the workload."""

    def __init__(self, name: str, target: Callable[[], None], stopping: threading.Event) -> None:
        self.name = name
        self.thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self.error: BaseException | None = None
        self._stopping = stopping

    def _run(self, target: Callable[[], None]) -> None:
        try:
            target()
        except _Stopped:
            pass
        except BaseException as exc:
            if self._stopping.is_set():
                # Its client was closed under it by stop(): the expected way to end.
                log.debug("workload thread %s ended at stop: %r", self.name, exc)
                return
            self.error = exc  # reported by Workload.errors, not lost
            log.exception("workload thread %s failed", self.name)


class Workload:
    """Concurrent publishers and subscribers against a Squall cluster, recorded in a history."""

    def __init__(
        self,
        target: Target,
        history: HistoryWriter,
        seed: int,
        topics: list[str],
        publishers: int = 5,
        subscribers: int = 2,
        push_subscribers: int = 1,
        *,
        batch_events_max: int = 5,
        pause_s_max: float = 0.02,
        call_timeout_s: float = 2.0,
        retry_total_ms: int = 3000,
        start_timeout_s: float = 60.0,
    ) -> None:
        if not target.gateway_addresses:
            raise ValueError("the target needs at least one gateway address")
        if not topics:
            raise ValueError("the workload needs at least one topic")
        for name, value, low in (
            ("publishers", publishers, 0),
            ("subscribers", subscribers, 0),
            ("push_subscribers", push_subscribers, 0),
            ("batch_events_max", batch_events_max, 1),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, not {value}")
        if call_timeout_s <= 0 or start_timeout_s <= 0 or pause_s_max < 0:
            raise ValueError("call_timeout_s and start_timeout_s must be > 0, pause_s_max >= 0")
        self.target = target
        self.seed = seed
        self.topics = list(topics)
        self._recorder = _Recorder(history)
        self._publishers = publishers
        self._subscribers = subscribers
        self._push_subscribers = push_subscribers
        self._batch_events_max = batch_events_max
        self._pause_s_max = pause_s_max
        self._call_timeout_s = call_timeout_s
        self._retry_total_ms = retry_total_ms
        self._start_timeout_s = start_timeout_s
        self._stop_publishing = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._publisher_workers: list[_Worker] = []
        self._subscriber_workers: list[_Worker] = []
        self._gateways: list[_Gateways] = []
        self._subscriptions: dict[str, squall.Subscription] = {}
        self._endpoints: list[squall.PushEndpoint] = []
        # Highest offset each subscription (process, topic) has received.
        self._delivered: dict[tuple[str, str], int] = {}
        self._subscribed: set[tuple[str, str]] = set()
        self._started = False

    # -- the async API -----------------------------------------------------------------

    async def start(self) -> None:
        """Creates the topics (retrying while the cluster comes up), then starts every thread."""
        if self._started:
            raise RuntimeError("the workload was already started")
        self._started = True
        await _in_thread(self._create_topics, self._start_timeout_s + CLOSE_WAIT_S)
        for i in range(1, self._publishers + 1):
            path, idempotent = PUBLISHER_KINDS[(i - 1) % len(PUBLISHER_KINDS)]
            loop = (
                functools.partial(self._unary_calls_loop, i)
                if path == "gateway_unary"
                else functools.partial(self._publish_loop, i, path, idempotent)
            )
            worker = _Worker(f"pub-{i}", loop, self._stopping)
            self._publisher_workers.append(worker)
        for i in range(1, self._subscribers + 1):
            for topic in self.topics:
                worker = _Worker(
                    f"sub-{i}/{topic}",
                    functools.partial(self._stream_loop, i, topic),
                    self._stopping,
                )
                self._subscriber_workers.append(worker)
        for i in range(1, self._push_subscribers + 1):
            worker = _Worker(f"push-{i}", functools.partial(self._push_setup, i), self._stopping)
            self._subscriber_workers.append(worker)
        for worker in (*self._subscriber_workers, *self._publisher_workers):
            worker.thread.start()

    async def stop(self, drain_timeout_s: float) -> None:
        """Stops publishing, lets subscribers catch up (bounded), closes everything.

        Returns within drain_timeout_s (plus a moment for closing) whatever the cluster
        does: threads still inside a call are left to die with the process, and their
        operations are recorded as indeterminate.
        """
        deadline = time.monotonic() + max(drain_timeout_s, 0.0)
        self._stop_publishing.set()
        join_until = min(deadline, time.monotonic() + PUBLISHER_JOIN_S_MAX)
        await _wait_until(
            lambda: not any(w.thread.is_alive() for w in self._publisher_workers), join_until
        )
        stuck = [w.name for w in self._publisher_workers if w.thread.is_alive()]
        if stuck:
            log.warning("publishers still inside a call at stop: %s", ", ".join(stuck))
        ends = await self._end_offsets(deadline)
        await _wait_until(lambda: self._caught_up(ends), deadline)
        behind = [
            f"{p} on {t}"
            for p, t in self._expected_subscribers()
            if not self._caught_up_one(p, t, ends)
        ]
        if behind:
            log.warning("subscribers behind at stop: %s", ", ".join(behind))
        await self._list_push_subscribers(deadline)
        try:
            await _in_thread(self._close_all, max(deadline - time.monotonic(), 0.0) + CLOSE_WAIT_S)
        except TimeoutError:
            log.warning("closing the workload's clients did not finish in time; left to exit")
        abandoned = self._recorder.close()
        if abandoned:
            log.warning("%d operations still running at stop, recorded indeterminate", abandoned)

    @property
    def errors(self) -> list[str]:
        """Threads that died of an unexpected error (a workload bug, not a cluster fault)."""
        return [
            f"{w.name}: {w.error!r}"
            for w in (*self._publisher_workers, *self._subscriber_workers)
            if w.error is not None
        ]

    # -- set-up --------------------------------------------------------------------------

    def _gateways_for(self, index: int) -> _Gateways:
        gateways = _Gateways(
            list(self.target.gateway_addresses),
            index,
            self._call_timeout_s,
            self._retry_total_ms,
        )
        with self._lock:
            self._gateways.append(gateways)
        return gateways

    def _create_topics(self) -> None:
        gateways = self._gateways_for(0)
        deadline = time.monotonic() + self._start_timeout_s
        missing = list(self.topics)
        failures = 0
        last = ""
        while missing:
            try:
                gateways.client().create_topic(missing[0])
                missing.pop(0)
            except squall.AlreadyExists:
                missing.pop(0)
            except squall.SquallError as exc:
                failures += 1
                last = _describe(exc)
                gateways.rotate()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"could not create topic '{missing[0]}' within "
                        f"{self._start_timeout_s} s: {last}"
                    ) from None
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(failures, 6)))

    # -- publishers ------------------------------------------------------------------------

    def _publish_loop(self, index: int, path: str, idempotent: bool) -> None:
        process = f"pub-{index}"
        topic_name = self.topics[(index - 1) % len(self.topics)]
        rng = random.Random(f"{self.seed}/{process}")
        publisher_id = f"chaos-{self.seed}-{process}" if idempotent else None
        gateways = self._gateways_for(index - 1)
        publisher: squall.Publisher | None = None
        counter = 0
        next_seq = 1
        again: list[tuple[int | None, str]] | None = None
        failures = 0
        # Bounded by the stop event: each pass publishes once or backs off.
        while not self._stop_publishing.is_set():
            if again is not None:
                events = again
            else:
                count = rng.randint(1, self._batch_events_max)
                events = [
                    (next_seq + i if idempotent else None, f"{process}:{counter + i + 1}")
                    for i in range(count)
                ]
                counter += count
                if idempotent:
                    next_seq += count
            try:
                client = gateways.client()
                if publisher_id is not None:
                    first_seq = events[0][0]
                    assert first_seq is not None
                    if publisher is None or publisher.next_sequence != first_seq:
                        _close_quietly(publisher)
                        publisher = None
                        publisher = _topic(client, topic_name).publisher(
                            publisher_id,
                            start_sequence=first_seq,
                            inflight_batches_max=1,
                            replicated=None if path == "gateway" else path == "replicated",
                        )
            except (squall.SquallError, grpc.RpcError, ValueError) as exc:
                # No publish was sent (asking for a proxy failed): not an operation.
                failures += 1
                log.debug("%s: no publisher: %s", process, _describe(exc))
                again = events
                gateways.rotate()
                self._backoff(rng, failures)
                continue
            op_id = self._recorder.invoke(
                process=process,
                op="publish",
                path=path,
                topic=topic_name,
                publisher_id=publisher_id,
                events=[{"seq": seq, "value": value} for seq, value in events],
            )
            try:
                if publisher is not None:
                    receipts = publisher.publish_many(
                        [value.encode() for _, value in events], batch_events=len(events)
                    )
                    offsets = [r.offset for r in receipts]
                    duplicates = [i for i, r in enumerate(receipts) if r.duplicate]
                else:
                    offsets, duplicates = self._publish_plain(
                        client, topic_name, [v for _, v in events]
                    )
            except Exception as exc:
                outcome = classify_publish_error(exc)
                self._recorder.complete(op_id, outcome, _describe(exc))
                again = events if (idempotent and outcome == "indeterminate") else None
                failures += 1
                # A fresh proxy (and gateway) next time: a non-replicated one is lost for
                # good, and a replicated one may be bound to a partitioned replica.
                _close_quietly(publisher)
                publisher = None
                gateways.rotate()
                self._backoff(rng, failures)
                continue
            # Which receipts said duplicate: the checker verifies each points at its event.
            if duplicates:
                self._recorder.complete(op_id, "ok", offsets=offsets, duplicates=duplicates)
            else:
                self._recorder.complete(op_id, "ok", offsets=offsets)
            again = None
            failures = 0
            if self._pause_s_max:
                self._stop_publishing.wait(rng.uniform(0, self._pause_s_max))
        _close_quietly(publisher)

    def _publish_plain(
        self, client: squall.Client, topic: str, values: list[str]
    ) -> tuple[list[int], list[int]]:
        """A publish without publisher id or sequences: the master cannot deduplicate it.
        Returns the receipts' offsets and the indices of any that said duplicate."""
        request = broker_pb2.PublishRequest(topic=topic)
        for value in values:
            request.events.add(payload=value.encode())
        stub = broker_pb2_grpc.PublisherStub(client.channel)
        response = stub.Publish(request, timeout=self._call_timeout_s)
        if len(response.receipts) != len(values):
            raise RuntimeError(
                f"{len(response.receipts)} receipts for {len(values)} events (compact?)"
            )
        receipts = response.receipts
        return [int(r.offset) for r in receipts], [i for i, r in enumerate(receipts) if r.duplicate]

    def _unary_calls_loop(self, index: int) -> None:
        """Idempotent unary publishes through the gateway, a batch's events each its own
        call and operation, all at once; an event whose call was indeterminate is sent
        again with its sequence (a new operation) until it is answered."""
        process = f"pub-{index}"
        topic_name = self.topics[(index - 1) % len(self.topics)]
        rng = random.Random(f"{self.seed}/{process}")
        publisher_id = f"chaos-{self.seed}-{process}"
        gateways = self._gateways_for(index - 1)
        counter = 0
        again: list[tuple[int, str]] = []
        failures = 0
        with concurrent.futures.ThreadPoolExecutor(
            self._batch_events_max, thread_name_prefix=f"{process}-call"
        ) as calls:
            # Bounded by the stop event: each pass publishes once or backs off.
            while not self._stop_publishing.is_set():
                if again:
                    events, again = again, []
                else:
                    count = rng.randint(1, self._batch_events_max)
                    events = [
                        (counter + i + 1, f"{process}:{counter + i + 1}") for i in range(count)
                    ]
                    counter += count
                try:
                    stub = broker_pb2_grpc.PublisherStub(gateways.client().channel)
                except (squall.SquallError, grpc.RpcError, ValueError) as exc:
                    failures += 1
                    log.debug("%s: no client: %s", process, _describe(exc))
                    again = events
                    gateways.rotate()
                    self._backoff(rng, failures)
                    continue
                started = [
                    (
                        seq,
                        value,
                        self._recorder.invoke(
                            process=process,
                            op="publish",
                            path="gateway_unary",
                            topic=topic_name,
                            publisher_id=publisher_id,
                            events=[{"seq": seq, "value": value}],
                        ),
                        calls.submit(self._unary_call, stub, topic_name, publisher_id, seq, value),
                    )
                    for seq, value in events
                ]
                failed = False
                for seq, value, op_id, call in started:
                    try:
                        # Bounded: the call has the call timeout; this allows for the
                        # thread's start.
                        pb = call.result(self._call_timeout_s + CLOSE_WAIT_S)
                    except Exception as exc:
                        outcome = classify_publish_error(exc)
                        self._recorder.complete(op_id, outcome, _describe(exc))
                        if outcome == "indeterminate":
                            again.append((seq, value))
                        failed = True
                        continue
                    if pb.duplicate:
                        self._recorder.complete(op_id, "ok", offsets=[pb.offset], duplicates=[0])
                    else:
                        self._recorder.complete(op_id, "ok", offsets=[pb.offset])
                if failed:
                    failures += 1
                    gateways.rotate()
                    self._backoff(rng, failures)
                    continue
                failures = 0
                if self._pause_s_max:
                    self._stop_publishing.wait(rng.uniform(0, self._pause_s_max))

    def _unary_call(
        self,
        stub: broker_pb2_grpc.PublisherStub,
        topic: str,
        publisher_id: str,
        seq: int,
        value: str,
    ) -> common_pb2.AckReceipt:
        """One event's unary `Publish` with its publisher id and sequence: its receipt."""
        request = broker_pb2.PublishRequest(topic=topic, publisher_id=publisher_id)
        request.events.add(payload=value.encode(), sequence=seq)
        response = stub.Publish(request, timeout=self._call_timeout_s)
        if len(response.receipts) != 1:
            raise RuntimeError(f"{len(response.receipts)} receipts for one event")
        return response.receipts[0]

    def _backoff(self, rng: random.Random, failures: int) -> None:
        ceiling = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(failures - 1, 10))
        self._stop_publishing.wait(rng.uniform(ceiling / 2, ceiling))

    # -- subscribers -----------------------------------------------------------------------

    def _stream_loop(self, index: int, topic_name: str) -> None:
        process = f"sub-{index}"
        name = f"chaos-{self.seed}-{process}"
        # Half the subscribers see every redelivered copy, half the library's deduplicated
        # stream; both must end up with every committed event.
        dedupe = index % 2 == 0
        rng = random.Random(f"{self.seed}/{process}/{topic_name}")
        gateways = self._gateways_for(index - 1)
        key = f"{process}/{topic_name}"
        op_id = self._recorder.invoke(
            process=process,
            op="subscribe",
            mode="stream",
            topic=topic_name,
            subscription=name,
            start_offset=0,
            dedupe=dedupe,
        )
        recorded = False
        failures = 0
        while not self._stopping.is_set():
            try:
                subscription = _topic(gateways.client(), topic_name).subscribe(
                    name, start="earliest", follow=True, dedupe=dedupe
                )
                with self._lock:
                    if self._stopping.is_set():
                        subscription.close()
                        break
                    self._subscriptions[key] = subscription
                if not recorded:
                    self._recorder.complete(op_id, "ok")
                    self._mark_subscribed(process, topic_name)
                    recorded = True
                acked_at = time.monotonic()
                for batch in subscription.batches():
                    if not batch:
                        continue
                    failures = 0
                    self._received(process, "stream", topic_name, name, batch)
                    # An ack is a replicated write: one per batch would make the
                    # subscriber as slow as the log, so it acks a few times a second, as
                    # apps do. A reconnect redelivers from the last ack.
                    if time.monotonic() - acked_at >= ACK_INTERVAL_S:
                        acked_at = time.monotonic()
                        try:
                            subscription.ack(batch[-1])
                        except squall.SquallError as exc:
                            # The cursor stays behind: the next stream redelivers. Allowed.
                            log.debug("%s: ack failed: %s", process, _describe(exc))
                    if self._stopping.is_set():
                        break
                # The stream ended without an error: open the next one after a moment.
                self._stopping.wait(BACKOFF_INITIAL_S)
            except (squall.SquallError, grpc.RpcError) as exc:
                failures += 1
                log.debug("%s on %s: stream failed: %s", process, topic_name, _describe(exc))
                gateways.rotate()
                ceiling = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(failures - 1, 10))
                self._stopping.wait(rng.uniform(ceiling / 2, ceiling))
        if not recorded:
            self._recorder.complete(op_id, "fail", "the workload stopped before it subscribed")

    def _push_setup(self, index: int) -> None:
        process = f"push-{index}"
        subscriber_id = f"chaos-{self.seed}-{process}"
        endpoint = squall.PushEndpoint(f"{self.target.host_address}:0", max_workers=4)
        with self._lock:
            self._endpoints.append(endpoint)

        def on_delivery(delivery: squall.PushDelivery) -> None:
            self._received(process, "push", delivery.topic, subscriber_id, delivery.messages)

        rng = random.Random(f"{self.seed}/{process}")
        gateways = self._gateways_for(index - 1)
        for topic_name in self.topics:
            failures = 0
            while not self._stopping.is_set():
                op_id = self._recorder.invoke(
                    process=process,
                    op="subscribe",
                    mode="push",
                    topic=topic_name,
                    subscription=subscriber_id,
                    start_offset=0,
                    endpoint=endpoint.address,
                )
                try:
                    info = _topic(gateways.client(), topic_name).subscribe_push(
                        subscriber_id,
                        endpoint,
                        reliability="ordered",
                        retry_count=-1,
                        start="earliest",
                        on_delivery=on_delivery,
                    )
                except squall.AlreadySubscribed:
                    # An earlier attempt whose answer was lost subscribed us (IceStorm's
                    # advice: treat it as done); the endpoint hosts the id already.
                    self._recorder.complete(op_id, "ok", "already subscribed")
                    self._mark_subscribed(process, topic_name)
                    break
                except (squall.SquallError, grpc.RpcError) as exc:
                    self._recorder.complete(op_id, classify_publish_error(exc), _describe(exc))
                    failures += 1
                    gateways.rotate()
                    ceiling = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(failures - 1, 10))
                    self._stopping.wait(rng.uniform(ceiling / 2, ceiling))
                    continue
                # The cluster's start cursor: what this subscriber is owed from.
                self._recorder.complete(op_id, "ok", start_offset=info.cursor)
                self._mark_subscribed(process, topic_name)
                break

    def _mark_subscribed(self, process: str, topic: str) -> None:
        with self._lock:
            self._subscribed.add((process, topic))

    def _received(
        self,
        process: str,
        mode: str,
        topic: str,
        subscription: str,
        messages: Sequence[squall.Message],
    ) -> None:
        if not messages:
            return
        self._recorder.deliver(
            process=process,
            mode=mode,
            topic=topic,
            subscription=subscription,
            events=[
                {"offset": m.offset, "value": m.payload.decode(errors="replace")} for m in messages
            ],
        )
        with self._lock:
            key = (process, topic)
            self._delivered[key] = max(
                self._delivered.get(key, -1), max(m.offset for m in messages)
            )

    # -- draining ----------------------------------------------------------------------------

    def _expected_subscribers(self) -> list[tuple[str, str]]:
        """The (process, topic) subscriptions that were made: those must catch up."""
        with self._lock:
            return sorted(self._subscribed)

    def _caught_up_one(self, process: str, topic: str, ends: dict[str, int]) -> bool:
        end = ends.get(topic)
        if end is None:
            return False
        with self._lock:
            return self._delivered.get((process, topic), -1) >= end - 1

    def _caught_up(self, ends: dict[str, int]) -> bool:
        return all(self._caught_up_one(p, t, ends) for p, t in self._expected_subscribers())

    async def _end_offsets(self, deadline: float) -> dict[str, int]:
        """Each topic's next offset once publishing stopped (what subscribers must reach)."""
        gateways = self._gateways_for(0)

        def read() -> dict[str, int]:
            ends: dict[str, int] = {}
            failures = 0
            while len(ends) < len(self.topics) and time.monotonic() < deadline:
                name = next(t for t in self.topics if t not in ends)
                try:
                    ends[name] = gateways.client().topic(name).info.next_offset
                except squall.SquallError:
                    failures += 1
                    gateways.rotate()
                    time.sleep(min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** min(failures, 6)))
            return ends

        try:
            return await _in_thread(read, max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return {}

    async def _list_push_subscribers(self, deadline: float) -> None:
        if not self._push_subscribers:
            return
        gateways = self._gateways_for(0)

        def listing() -> None:
            for name in self.topics:
                op_id = self._recorder.invoke(
                    process="workload", op="list_push_subscribers", topic=name
                )
                try:
                    found = _topic(gateways.client(), name).push_subscribers()
                except squall.SquallError as exc:
                    self._recorder.complete(op_id, "fail", _describe(exc))
                    continue
                self._recorder.complete(
                    op_id, "ok", subscriber_ids=sorted(s.subscriber_id for s in found)
                )

        try:
            await _in_thread(listing, max(deadline - time.monotonic(), 0.5))
        except TimeoutError:
            log.warning("listing push subscribers did not finish in time")

    def _close_all(self) -> None:
        with self._lock:
            # Under the lock: a subscriber thread registers its stream under it too, so
            # none is opened after this and left running.
            self._stopping.set()
            subscriptions = list(self._subscriptions.values())
            endpoints = list(self._endpoints)
            gateways = list(self._gateways)
        for subscription in subscriptions:
            subscription.close()
        for endpoint in endpoints:
            endpoint.close(grace_s=0.2)
        for each in gateways:
            each.close()


def _close_quietly(publisher: squall.Publisher | None) -> None:
    if publisher is None:
        return
    try:
        publisher.close()
    except Exception:  # a broken publisher's close must not stop the workload
        log.debug("closing a publisher failed", exc_info=True)


async def _wait_until(condition: Callable[[], bool], deadline: float) -> bool:
    """Polls condition until it holds or the deadline passes; returns whether it held."""
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _in_thread(fn: Callable[[], _T], timeout_s: float) -> _T:
    """Runs a blocking call in a daemon thread; TimeoutError after timeout_s.

    Not asyncio.to_thread: its executor's threads are joined when the loop closes, so one
    call hanging on a broken cluster would hang the harness's exit.
    """
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:
            outcome: tuple[bool, Any] = (False, exc)
        else:
            outcome = (True, result)
        try:
            if outcome[0]:
                future.set_result(outcome[1])
            else:
                future.set_exception(outcome[1])
        except concurrent.futures.InvalidStateError:
            pass  # the caller stopped waiting (its timeout): nobody wants the result

    threading.Thread(target=run, name="chaos-call", daemon=True).start()
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
