"""Destroying a topic while it is in use, with real processes (issue 20, item 4).

Goal: what the apps attached to a topic see when an operator destroys it — a following
subscriber's iteration ends with `NotFound` naming the topic (not a hang, not a silent
end), a publisher's next publish raises `NotFound` and stores nothing, a push
subscriber gets no further deliveries and is gone with the topic; and the name can be
reused at once: the new topic starts empty, with no subscriptions or push subscribers
of the old one, and a publisher with the old id stores its first event at offset 0.
"""

from __future__ import annotations

import threading

import pytest

import squall
from tests.integration.conftest import LocalCluster, wait_for
from tests.integration.test_push import Recorder

pytestmark = pytest.mark.integration

WAIT_S = 20.0


class _Reader:
    """A following durable subscription read in a thread; remembers how it ended."""

    def __init__(self, topic: squall.Topic) -> None:
        self.offsets: list[int] = []
        self.ended_with: BaseException | None = None
        self.ended = threading.Event()
        self._subscription = topic.subscribe("reader", follow=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self._subscription:
                self.offsets.append(message.offset)
        except BaseException as error:  # what the app would see
            self.ended_with = error
        finally:
            self.ended.set()

    def close(self) -> None:
        self._subscription.close()
        self._thread.join(WAIT_S)


def test_destroying_a_topic_tells_its_subscribers_publishers_and_push_subscribers(
    single: LocalCluster,
) -> None:
    with (
        squall.connect(single.gateway_address, timeout_s=10.0) as client,
        squall.PushEndpoint() as endpoint,
    ):
        client.create_topic("doomed")
        topic = client.topic("doomed")
        publisher = topic.publisher("app")
        pushed = Recorder()
        topic.subscribe_push("pusher", endpoint, on_delivery=pushed)
        reader = _Reader(topic)
        try:
            assert publisher.publish(b"before").offset == 0
            wait_for(lambda: pushed.offsets() == {0}, WAIT_S, "the push delivery of offset 0")
            wait_for(lambda: reader.offsets == [0], WAIT_S, "the subscriber reading offset 0")

            client.destroy_topic("doomed")

            assert reader.ended.wait(WAIT_S), "the following subscriber was left hanging"
            assert isinstance(reader.ended_with, squall.NotFound), repr(reader.ended_with)
            assert "doomed" in str(reader.ended_with)
            with pytest.raises(squall.NotFound, match="doomed"):
                publisher.publish(b"after")
            with pytest.raises(squall.NotFound, match="doomed"):
                topic.push_subscribers()

            client.create_topic("doomed")
            reborn = client.topic("doomed")
            assert reborn.push_subscribers() == []
            assert reborn.subscriptions() == []
            fresh = Recorder()
            reborn.subscribe_push("fresh", endpoint, on_delivery=fresh)
            with reborn.publisher("app") as again:
                receipt = again.publish(b"reborn")
            assert (receipt.offset, receipt.duplicate) == (0, False)
            with reborn.subscribe(follow=False) as everything:
                assert [m.payload for m in everything] == [b"reborn"]
            # The old push subscriber went with the old topic: once the new one has had
            # the new event, the old one still has only its delivery from before.
            wait_for(lambda: fresh.offsets() == {0}, WAIT_S, "the new push subscriber's event")
            assert [[m.payload for m in d.messages] for d in pushed.batches()] == [[b"before"]]
        finally:
            reader.close()
            publisher.close()
