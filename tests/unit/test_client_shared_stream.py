"""The client's shared publish stream (squall._publish_mux), against the in-memory broker.

Many threads, each with a publisher of its own, publish one event at a time through one
`Client`: their events share one stream and, while its window is full, one request
(PublishRequest.parts), yet every caller gets its own receipt, per-publisher order holds,
one caller's refused event fails that caller alone, and a broken stream loses nothing
acknowledged and stores nothing twice.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

import squall
from squall._publish_mux import SHARED_INFLIGHT_MAX
from squall.v1 import broker_pb2
from tests.unit.test_client import (
    MAX_EVENT_BYTES,
    FakeBroker,
    _stays,
    serve_fake,
    wait_until,
)

# Callers that fill the shared stream's window (held by the broker's gate).
FILL = SHARED_INFLIGHT_MAX


class _LossyBroker(FakeBroker):
    """Stores a request, then loses its answer by ending the stream (every `lose_every`-th
    request; a request with parts counts once), or answers like a server without parts."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_every = 0
        self.knows_parts = True
        self._count = 0

    def PublishStream(
        self,
        request_iterator: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        if self.knows_parts and not self.lose_every:
            yield from super().PublishStream(request_iterator, context)
            return
        with self.cond:
            self.publish_stream_calls += 1
        for request in request_iterator:
            if request.parts and not self.knows_parts:
                # As a master without parts answers a request with no events of its own.
                # (A failure answered inline does not echo the request's id.)
                yield broker_pb2.PublishResponse(
                    error=broker_pb2.PublishError(
                        code="INVALID_ARGUMENT", message="a publish needs at least one event"
                    ),
                )
                continue
            if request.parts:
                with self.cond:
                    self.joined_requests_seen += 1
                response = broker_pb2.PublishResponse(request_id=request.request_id)
                response.parts.extend(self._apply_inline(part) for part in request.parts)
            else:
                response = self._apply_inline(request)
                if response.HasField("error"):
                    response.request_id = 0
            with self.cond:
                self._count += 1
                lose = self.lose_every and self._count % self.lose_every == 0
            if lose:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the master went away")
            yield response


class _DeposedOnce(_LossyBroker):
    """Answers the first publish inline as a master that is no longer one (a redirect),
    storing nothing, and goes on answering on the same stream."""

    def __init__(self) -> None:
        super().__init__()
        self.redirects = 1

    def _apply_inline(self, request: broker_pb2.PublishRequest) -> broker_pb2.PublishResponse:
        with self.cond:
            redirect = self.redirects > 0
            self.redirects -= redirect
        if redirect:
            return broker_pb2.PublishResponse(
                request_id=request.request_id,
                error=broker_pb2.PublishError(code="UNAVAILABLE", message="not the master"),
            )
        return super()._apply_inline(request)


def test_a_part_answered_by_a_former_master_abandons_the_stream() -> None:
    """The caller's retry goes on a fresh stream (through the gateway to the master it
    follows now), not on the stream of the master that said it is no longer one; the
    event is stored once, and the next publish goes on after it."""
    deposed = _DeposedOnce()
    server, address = serve_fake(deposed)
    try:
        with squall.connect(address, timeout_s=5.0) as client:
            client.create_topic("t")
            publisher = client.topic("t").publisher("p")
            receipts = [publisher.publish(b"first"), publisher.publish(b"second")]
    finally:
        server.stop(grace=None)
    assert deposed.publish_stream_calls == 2
    assert [r.offset for r in receipts] == [0, 1]
    assert [(e.publisher_id, e.sequence) for e in deposed.topics["t"].events] == [
        ("p", 1),
        ("p", 2),
    ]


@pytest.fixture
def broker() -> Iterator[_LossyBroker]:
    fake = _LossyBroker()
    server, address = serve_fake(fake)
    fake.address = address  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        if fake.gate is not None:
            fake.gate.set()
        server.stop(grace=None)


@pytest.fixture
def client(broker: _LossyBroker) -> Iterator[squall.Client]:
    with squall.connect(broker.address, timeout_s=5.0) as c:  # type: ignore[attr-defined]
        yield c


def _run_threads(count: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a publishing thread hung"
    assert not errors, errors[:3]


def _check_stored_once(
    broker: FakeBroker, topic: str, acked: dict[tuple[str, int], squall.Receipt]
) -> None:
    """Every acknowledged event is stored once, at its receipt's offset, and each
    publisher's events are stored in sequence order."""
    with broker.cond:
        events = list(broker.topics[topic].events)
    keys = collections.Counter((e.publisher_id, e.sequence) for e in events)
    assert not [k for k, n in keys.items() if n > 1], "an event was stored twice"
    for (publisher_id, sequence), receipt in acked.items():
        stored = events[receipt.offset]
        assert (stored.publisher_id, stored.sequence) == (publisher_id, sequence)
    by_publisher: dict[str, list[int]] = collections.defaultdict(list)
    for event in events:
        by_publisher[event.publisher_id].append(event.sequence)
    for publisher_id, sequences in by_publisher.items():
        assert sequences == sorted(sequences), f"{publisher_id} stored out of order"


def test_threads_with_own_publishers_share_one_stream_and_requests(
    client: squall.Client, broker: _LossyBroker
) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    publishers = [topic.publisher(f"app-{i}") for i in range(24)]
    acked: dict[tuple[str, int], squall.Receipt] = {}
    offsets: dict[str, list[int]] = collections.defaultdict(list)
    # The first publishes find the window closed, so the later ones wait and join.
    broker.gate = threading.Event()

    def publish(index: int) -> None:
        publisher = publishers[index]
        for sequence in range(1, 16):
            receipt = publisher.publish(b"event %d" % sequence)
            acked[(publisher.publisher_id, sequence)] = receipt
            offsets[publisher.publisher_id].append(receipt.offset)

    releaser = threading.Thread(
        target=lambda: (wait_until(lambda: broker.requests_seen >= 1), broker.gate.set()),  # type: ignore[union-attr]
        daemon=True,
    )
    releaser.start()
    _run_threads(len(publishers), publish)
    assert len(acked) == 24 * 15
    for publisher_offsets in offsets.values():
        assert publisher_offsets == sorted(publisher_offsets)
    _check_stored_once(broker, "t", acked)
    # One stream for all of them, and requests that carried several publishers' events.
    assert broker.publish_stream_calls == 1
    assert broker.joined_requests_seen >= 1
    assert broker.requests_seen < len(acked)
    for publisher in publishers:
        publisher.close()


def test_a_refused_event_fails_only_its_caller(client: squall.Client, broker: _LossyBroker) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    shared = topic.publisher("shared")
    broker.gate = threading.Event()
    outcomes: dict[str, squall.Receipt | BaseException] = {}
    too_big = b"x" * (MAX_EVENT_BYTES + 1)
    # The first callers fill the window; the rest wait and go out as one joined request in
    # which one publisher of its own and one caller of the shared publisher send an event
    # over the limit.
    calls: list[tuple[str, squall.Publisher, bytes]] = [
        (f"fill-{i}", topic.publisher(f"fill-{i}"), b"fill") for i in range(FILL)
    ]
    calls += [
        ("ok-a", topic.publisher("ok-a"), b"fine"),
        ("big", topic.publisher("big"), too_big),
        ("ok-b", topic.publisher("ok-b"), b"fine"),
        ("shared-ok", shared, b"fine"),
        ("shared-big", shared, too_big),
    ]

    def publish(index: int) -> None:
        name, publisher, payload = calls[index]
        try:
            outcomes[name] = publisher.publish(payload)
        except squall.SquallError as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=publish, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads[:FILL]:
        thread.start()
    wait_until(lambda: all(p.next_sequence > 1 for _, p, _ in calls[:FILL]))
    for thread in threads[FILL:]:
        thread.start()
    wait_until(lambda: all(p.next_sequence > 1 for _, p, _ in calls))
    broker.gate.set()
    for thread in threads:
        thread.join(30)
    for name in ("big", "shared-big"):
        error = outcomes[name]
        assert isinstance(error, squall.InvalidArgument), (name, error)
        assert not error.maybe_stored
    receipts = {n: r for n, r in outcomes.items() if isinstance(r, squall.Receipt)}
    assert sorted(receipts) == sorted(n for n in outcomes if "big" not in n)
    assert broker.joined_requests_seen >= 1
    # The refusals were answered inline: the stream went on.
    assert broker.publish_stream_calls == 1
    stored = {(e.publisher_id, e.payload) for e in broker.topics["t"].events}
    assert len(broker.topics["t"].events) == FILL + 3
    assert ("big", too_big) not in stored and ("shared", too_big) not in stored


def test_a_broken_shared_stream_loses_nothing_and_stores_nothing_twice(
    client: squall.Client, broker: _LossyBroker
) -> None:
    """Every 7th request is stored and its answer lost with the stream: its callers and
    every later one in flight are indeterminate, retried with the same ids on a fresh
    stream, and the master's deduplication answers the stored ones."""
    client.create_topic("t")
    topic = client.topic("t")
    broker.lose_every = 7
    publishers = [topic.publisher(f"app-{i}") for i in range(12)]
    acked: dict[tuple[str, int], squall.Receipt] = {}

    def publish(index: int) -> None:
        publisher = publishers[index]
        for sequence in range(1, 21):
            acked[(publisher.publisher_id, sequence)] = publisher.publish(b"e%d" % sequence)

    _run_threads(len(publishers), publish)
    assert len(acked) == 12 * 20
    assert broker.publish_stream_calls > 1
    assert any(r.duplicate for r in acked.values())
    assert sum(p.resends for p in publishers) > 0
    _check_stored_once(broker, "t", acked)
    assert len(broker.topics["t"].events) == len(acked)


def test_a_server_without_parts_gets_each_event_alone(
    client: squall.Client, broker: _LossyBroker
) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    broker.knows_parts = False
    broker.gate = None
    publishers = [topic.publisher(f"app-{i}") for i in range(16)]
    acked: dict[tuple[str, int], squall.Receipt] = {}

    def publish(index: int) -> None:
        publisher = publishers[index]
        for sequence in range(1, 11):
            acked[(publisher.publisher_id, sequence)] = publisher.publish(b"e%d" % sequence)

    _run_threads(len(publishers), publish)
    _check_stored_once(broker, "t", acked)
    assert len(broker.topics["t"].events) == 16 * 10


def test_own_stream_calls_wait_for_the_shared_stream(
    client: squall.Client, broker: _LossyBroker
) -> None:
    """A publisher's publish_many after a publish() on the shared stream comes after it:
    sequences are stored in order across the two streams."""
    client.create_topic("t")
    publisher = client.topic("t").publisher("p")
    broker.gate = threading.Event()
    first: list[squall.Receipt] = []
    lone = threading.Thread(target=lambda: first.append(publisher.publish(b"lone")))
    lone.start()
    wait_until(lambda: broker.requests_seen >= 1)
    many: list[list[squall.Receipt]] = []
    batch = threading.Thread(target=lambda: many.append(publisher.publish_many([b"a", b"b"])))
    batch.start()
    # Nothing of publish_many goes out while the lone publish is unanswered.
    assert _stays(lambda: broker.requests_seen == 1, duration_s=0.3)
    broker.gate.set()
    lone.join(10)
    batch.join(10)
    assert first[0].offset == 0
    assert [r.offset for r in many[0]] == [1, 2]
    assert [e.sequence for e in broker.topics["t"].events] == [1, 2, 3]
    publisher.close()


def test_a_lone_refused_publish_fails_its_caller_and_the_stream_goes_on(
    client: squall.Client, broker: _LossyBroker
) -> None:
    client.create_topic("t")
    publisher = client.topic("t").publisher("p")
    assert publisher.publish(b"before").offset == 0
    client.destroy_topic("t")
    with pytest.raises(squall.NotFound, match="t"):
        publisher.publish(b"after")
    client.create_topic("t")
    assert client.topic("t").publisher("q").publish(b"again").offset == 0
    # The refusal was answered on the shared stream, which went on.
    assert broker.publish_stream_calls == 1
