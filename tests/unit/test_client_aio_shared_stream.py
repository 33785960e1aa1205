"""The asyncio client's shared publish stream (squall.aio._publish_mux), against the
in-memory broker.

Many tasks on one event loop, each with a `squall.aio` publisher of its own, publish one
event at a time through one client: their events share one stream and, while its window
is full, one request (PublishRequest.parts), yet every caller gets its own receipt,
per-publisher order holds, one caller's refused event fails that caller alone, a broken
stream loses nothing acknowledged and stores nothing twice, a cancelled caller's event is
withdrawn if it was never sent and otherwise stays ahead of the publisher's later ones,
past the deadline a sent event is indeterminate and a waiting one not sent, and closing
waits for what is in flight.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import squall
import squall.aio
from squall._publish_join import SHARED_INFLIGHT_MAX
from tests.unit.test_client import MAX_EVENT_BYTES, serve_fake
from tests.unit.test_client_shared_stream import _check_stored_once, _DeposedOnce, _LossyBroker

# Callers that fill the shared stream's window (held by the broker's gate).
FILL = SHARED_INFLIGHT_MAX
_T = TypeVar("_T")


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


def _run(broker: _LossyBroker, body: Callable[[squall.aio.Client], Awaitable[_T]]) -> _T:
    """Runs `body` with a client of the broker on a fresh event loop."""

    async def main() -> _T:
        address: str = broker.address  # type: ignore[attr-defined]
        async with squall.aio.connect(address, timeout_s=5.0) as client:
            await client.create_topic("t")
            return await body(client)

    return asyncio.run(main())


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Waits, without blocking the loop, until predicate() holds (the broker's threads
    change what it reads); fails the test after timeout_s."""
    # Bounded: timeout_s / 0.005 s polls.
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def _stays(predicate: Callable[[], bool], duration_s: float) -> bool:
    """Whether predicate() holds throughout a short window (a negative can only be timed)."""
    for _ in range(int(duration_s / 0.01)):
        if not predicate():
            return False
        await asyncio.sleep(0.01)
    return True


def test_tasks_with_own_publishers_share_one_stream_and_requests(broker: _LossyBroker) -> None:
    acked: dict[tuple[str, int], squall.Receipt] = {}
    offsets: dict[str, list[int]] = collections.defaultdict(list)
    # The first publishes find the window closed, so the later ones wait and join.
    broker.gate = threading.Event()

    async def body(client: squall.aio.Client) -> None:
        topic = await client.topic("t")
        publishers = [await topic.publisher(f"app-{i}") for i in range(24)]

        async def publish(publisher: squall.aio.Publisher) -> None:
            for sequence in range(1, 16):
                receipt = await publisher.publish(b"event %d" % sequence)
                acked[(publisher.publisher_id, sequence)] = receipt
                offsets[publisher.publisher_id].append(receipt.offset)

        async def release() -> None:
            await _until(lambda: broker.requests_seen >= 1)
            broker.gate.set()  # type: ignore[union-attr]

        await asyncio.gather(release(), *(publish(p) for p in publishers))
        assert all(p.streams_opened == 1 for p in publishers)

    _run(broker, body)
    assert len(acked) == 24 * 15
    for publisher_offsets in offsets.values():
        assert publisher_offsets == sorted(publisher_offsets)
    _check_stored_once(broker, "t", acked)
    # One stream for all of them, and requests that carried several publishers' events.
    assert broker.publish_stream_calls == 1
    assert broker.joined_requests_seen >= 1
    assert broker.requests_seen < len(acked)


def test_a_refused_event_fails_only_its_caller(broker: _LossyBroker) -> None:
    broker.gate = threading.Event()
    too_big = b"x" * (MAX_EVENT_BYTES + 1)

    async def body(client: squall.aio.Client) -> dict[str, Any]:
        topic = await client.topic("t")
        shared = await topic.publisher("shared")
        fill = [(f"fill-{i}", await topic.publisher(f"fill-{i}"), b"fill") for i in range(FILL)]
        # They wait for a slot and go out as one joined request in which one publisher of
        # its own and one caller of the shared publisher send an event over the limit.
        rest = [
            ("ok-a", await topic.publisher("ok-a"), b"fine"),
            ("big", await topic.publisher("big"), too_big),
            ("ok-b", await topic.publisher("ok-b"), b"fine"),
            ("shared-ok", shared, b"fine"),
            ("shared-big", shared, too_big),
        ]
        outcomes: dict[str, Any] = {}

        async def publish(name: str, publisher: squall.aio.Publisher, payload: bytes) -> None:
            try:
                outcomes[name] = await publisher.publish(payload)
            except squall.SquallError as exc:
                outcomes[name] = exc

        tasks = [asyncio.create_task(publish(*call)) for call in fill]
        await _until(lambda: all(p.next_sequence > 1 for _, p, _ in fill))
        tasks += [asyncio.create_task(publish(*call)) for call in rest]
        await _until(lambda: all(p.next_sequence > 1 for _, p, _ in rest))
        broker.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(*tasks)
        return outcomes

    outcomes = _run(broker, body)
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
    broker: _LossyBroker,
) -> None:
    """Every 7th request is stored and its answer lost with the stream: its callers and
    every later one in flight are indeterminate, retried with the same ids on a fresh
    stream, and the master's deduplication answers the stored ones."""
    broker.lose_every = 7
    acked: dict[tuple[str, int], squall.Receipt] = {}

    async def body(client: squall.aio.Client) -> int:
        topic = await client.topic("t")
        publishers = [await topic.publisher(f"app-{i}") for i in range(12)]

        async def publish(publisher: squall.aio.Publisher) -> None:
            for sequence in range(1, 21):
                receipt = await publisher.publish(b"e%d" % sequence)
                acked[(publisher.publisher_id, sequence)] = receipt

        await asyncio.gather(*(publish(p) for p in publishers))
        return sum(p.resends for p in publishers)

    resends = _run(broker, body)
    assert len(acked) == 12 * 20
    assert broker.publish_stream_calls > 1
    assert any(r.duplicate for r in acked.values())
    assert resends > 0
    _check_stored_once(broker, "t", acked)
    assert len(broker.topics["t"].events) == len(acked)


def test_a_part_answered_by_a_former_master_abandons_the_stream() -> None:
    """The caller's retry goes on a fresh stream (through the gateway to the master it
    follows now), not on the stream of the master that said it is no longer one."""
    deposed = _DeposedOnce()
    server, address = serve_fake(deposed)
    deposed.address = address  # type: ignore[attr-defined]
    try:

        async def body(client: squall.aio.Client) -> list[squall.Receipt]:
            publisher = await (await client.topic("t")).publisher("p")
            return [await publisher.publish(b"first"), await publisher.publish(b"second")]

        receipts = _run(deposed, body)
    finally:
        server.stop(grace=None)
    assert deposed.publish_stream_calls == 2
    assert [r.offset for r in receipts] == [0, 1]
    assert [(e.publisher_id, e.sequence) for e in deposed.topics["t"].events] == [
        ("p", 1),
        ("p", 2),
    ]


def test_a_server_without_parts_gets_each_event_alone(broker: _LossyBroker) -> None:
    broker.knows_parts = False
    acked: dict[tuple[str, int], squall.Receipt] = {}

    async def body(client: squall.aio.Client) -> None:
        topic = await client.topic("t")
        publishers = [await topic.publisher(f"app-{i}") for i in range(16)]

        async def publish(publisher: squall.aio.Publisher) -> None:
            for sequence in range(1, 11):
                acked[(publisher.publisher_id, sequence)] = await publisher.publish(b"e")

        await asyncio.gather(*(publish(p) for p in publishers))

    _run(broker, body)
    _check_stored_once(broker, "t", acked)
    assert len(broker.topics["t"].events) == 16 * 10


def test_a_cancelled_publish_is_withdrawn_if_unsent_and_otherwise_goes_first(
    broker: _LossyBroker,
) -> None:
    broker.gate = threading.Event()

    async def body(client: squall.aio.Client) -> list[squall.Receipt]:
        topic = await client.topic("t")
        sent = await topic.publisher("sent")
        waiting = await topic.publisher("waiting")
        # The window fills with "sent"'s event and another, each sent in a turn of its own
        # (the publishes of one turn go as one request: a publish's sequence is taken in
        # its turn, its request sent at the turn's end, before `_until` looks again; the
        # broker reads no further than the first); "waiting"'s event waits.
        first = asyncio.create_task(sent.publish(b"sent-1"))
        await _until(lambda: sent.next_sequence == 2 and broker.requests_seen >= 1)
        other_publisher = await topic.publisher("other")
        other = asyncio.create_task(other_publisher.publish(b"other"))
        await _until(lambda: other_publisher.next_sequence == 2)
        unsent = asyncio.create_task(waiting.publish(b"never"))
        await _until(lambda: waiting.next_sequence == 2)
        first.cancel()
        unsent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        with pytest.raises(asyncio.CancelledError):
            await unsent
        # "sent"'s event is on the stream: its next events (on its own stream) wait for it.
        many = asyncio.create_task(sent.publish_many([b"sent-2", b"sent-3"]))
        assert await _stays(lambda: broker.requests_seen == 1, duration_s=0.3)
        broker.gate.set()
        await other
        receipts = await many
        receipts.append(await waiting.publish(b"waiting-2"))
        return receipts

    receipts = _run(broker, body)
    events = broker.topics["t"].events
    assert [(e.publisher_id, e.sequence) for e in events if e.publisher_id == "sent"] == [
        ("sent", 1),
        ("sent", 2),
        ("sent", 3),
    ]
    # The withdrawn event was never sent; the publisher's next one took the next sequence.
    assert [
        (e.publisher_id, e.sequence, e.payload) for e in events if e.publisher_id == "waiting"
    ] == [("waiting", 2, b"waiting-2")]
    assert [events[r.offset].payload for r in receipts] == [b"sent-2", b"sent-3", b"waiting-2"]


def test_closing_waits_for_lone_publishes_in_flight(broker: _LossyBroker) -> None:
    broker.gate = threading.Event()

    async def body(client: squall.aio.Client) -> squall.Receipt:
        publisher = await (await client.topic("t")).publisher("p")
        lone = asyncio.create_task(publisher.publish(b"lone"))
        await _until(lambda: broker.requests_seen >= 1)
        closing = asyncio.create_task(publisher.close())
        assert await _stays(lambda: not closing.done(), duration_s=0.3)
        broker.gate.set()
        await closing
        assert lone.done()
        with pytest.raises(ValueError, match="closed"):
            await publisher.publish(b"after")
        return await lone

    receipt = _run(broker, body)
    assert receipt.offset == 0
    assert [e.payload for e in broker.topics["t"].events] == [b"lone"]


def test_a_closed_client_refuses_publishes(broker: _LossyBroker) -> None:
    async def main() -> None:
        address: str = broker.address  # type: ignore[attr-defined]
        client = await squall.aio.connect(address, timeout_s=5.0)
        await client.create_topic("t")
        publisher = await (await client.topic("t")).publisher("p")
        assert (await publisher.publish(b"one")).offset == 0
        await client.close()
        with pytest.raises(ValueError, match="closed"):
            await publisher.publish(b"two")

    asyncio.run(main())
    assert broker.publish_stream_calls == 1


def test_without_the_shared_stream_each_publisher_has_its_own(broker: _LossyBroker) -> None:
    async def main() -> None:
        address: str = broker.address  # type: ignore[attr-defined]
        async with squall.aio.connect(address, timeout_s=5.0, share_publish_stream=False) as c:
            await c.create_topic("t")
            topic = await c.topic("t")
            for name in ("a", "b"):
                publisher = await topic.publisher(name)
                assert (await publisher.publish(b"x")).offset == ("a", "b").index(name)

    asyncio.run(main())
    assert broker.publish_stream_calls == 2
    assert broker.joined_requests_seen == 0


def test_past_the_deadline_sent_events_are_indeterminate_and_waiting_ones_not_sent(
    broker: _LossyBroker,
) -> None:
    """Nothing answers (the broker's gate stays closed) and retries are off: the callers
    whose events went out learn their outcome is unknown; the one whose event still
    waited for a slot learns it was not sent, and it never is."""
    broker.gate = threading.Event()

    async def main() -> dict[str, BaseException]:
        address: str = broker.address  # type: ignore[attr-defined]
        async with squall.aio.connect(address, timeout_s=0.3, retry_attempts_max=1) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            names = [f"sent-{i}" for i in range(FILL)] + ["waiting"]
            publishers = {name: await topic.publisher(name) for name in names}
            # Each "sent-" event goes in a turn of its own (its sequence taken in the turn,
            # its request sent at the turn's end), filling the window.
            calls = []
            for name in names:
                publisher = publishers[name]
                calls.append(asyncio.create_task(publisher.publish(b"x")))
                await _until(lambda publisher=publisher: publisher.next_sequence == 2)
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            broker.gate.set()  # type: ignore[union-attr]
            # The shared stream goes on, on a fresh stream.
            await publishers["waiting"].publish(b"after")
            return {
                n: o for n, o in zip(names, outcomes, strict=True) if isinstance(o, BaseException)
            }

    outcomes = asyncio.run(main())
    assert sorted(outcomes) == sorted([f"sent-{i}" for i in range(FILL)] + ["waiting"])
    for name, error in outcomes.items():
        assert isinstance(error, squall.SquallError), (name, error)
        assert error.maybe_stored == (name != "waiting"), (name, error)
    stored = [
        (e.sequence, e.payload) for e in broker.topics["t"].events if e.publisher_id == "waiting"
    ]
    assert stored == [(2, b"after")]


def test_tasks_that_one_answer_wakes_publish_again_as_one_request(broker: _LossyBroker) -> None:
    """Tasks sharing a publisher, each publishing one event at a time: the tasks an answer
    wakes publish again in the same loop turn, and their events go out together at its
    end. Sent at once, the first of them took the free slot alone and the rest waited for
    the next (issue 16: with 64 tasks a third of the requests carried one event)."""
    tasks, rounds = 16, 20

    async def body(client: squall.aio.Client) -> int:
        publisher = await (await client.topic("t")).publisher("shared")
        await publisher.publish(b"warm-up")
        before = broker.requests_seen

        async def run(task: int) -> None:
            for round_ in range(rounds):
                await publisher.publish(b"%d-%d" % (task, round_))

        await asyncio.gather(*(run(task) for task in range(tasks)))
        return broker.requests_seen - before

    requests = _run(broker, body)
    assert requests == rounds
    payloads = [e.payload for e in broker.topics["t"].events]
    assert len(payloads) == 1 + tasks * rounds == len(set(payloads))
    for task in range(tasks):
        mine = [p for p in payloads if p.startswith(b"%d-" % task)]
        assert mine == [b"%d-%d" % (task, round_) for round_ in range(rounds)]
