"""A threaded subscription whose stream ended is freed once the app lets go of it.

Its finalizer (an abandoned subscription must not keep a following stream open) holds the
current call; an ended call is the RpcError it raised, whose traceback holds the frames
that read it, the subscription's own among them. Kept there, it made every subscription
closed while a thread was blocked on it, or whose stream failed, live for good.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

import squall
from tests.unit.test_client import FakeBroker, broker, wait_until

__all__ = ["broker"]  # the fixture, imported for pytest

ROUNDS = 10


def _live_subscriptions() -> int:
    gc.collect()
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is squall.Subscription)


@pytest.fixture
def topic(broker: FakeBroker) -> Iterator[squall.Topic]:
    with squall.connect(broker.address, timeout_s=5.0) as client:  # type: ignore[attr-defined]
        client.create_topic("t")
        handle = client.topic("t")
        with handle.publisher() as publisher:
            publisher.publish(b"first")
        yield handle


def _close_while_blocked(topic: squall.Topic, broker: FakeBroker) -> None:
    started = broker.subscribes_started
    sub = topic.subscribe(start="latest")
    seen: list[squall.Message] = []
    reader = threading.Thread(target=lambda: seen.extend(sub))
    reader.start()
    # Nothing is published after "latest": the reader waits on the stream.
    wait_until(lambda: broker.subscribes_started == started + 1)
    sub.close()
    reader.join(30)
    assert not reader.is_alive(), "close() left the iterating thread blocked"
    assert seen == []


def test_subscriptions_closed_while_a_thread_reads_them_are_freed(
    topic: squall.Topic, broker: FakeBroker
) -> None:
    before = _live_subscriptions()
    for _ in range(ROUNDS):
        _close_while_blocked(topic, broker)
    assert _live_subscriptions() == before


def test_subscriptions_whose_stream_failed_are_freed(topic: squall.Topic) -> None:
    client = topic._client
    before = _live_subscriptions()
    for round_ in range(ROUNDS):
        name = f"gone-{round_}"
        client.create_topic(name)
        gone = client.topic(name)
        client.destroy_topic(name)
        sub = gone.subscribe()
        with pytest.raises(squall.NotFound):
            next(sub)
        del sub  # never closed: the app dropped it after the error
    assert _live_subscriptions() == before


def test_closed_and_abandoned_subscriptions_are_freed(topic: squall.Topic) -> None:
    before = _live_subscriptions()
    for _ in range(ROUNDS):
        with topic.subscribe() as sub:
            assert next(sub).payload == b"first"
        abandoned = topic.subscribe()
        assert next(abandoned).payload == b"first"
        del abandoned  # its finalizer ends the stream
    del sub
    assert _live_subscriptions() == before
