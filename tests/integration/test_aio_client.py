"""The asyncio client (`squall.aio`) against real service processes (issue 17 item 2).

Goals, each a behaviour an app sees:

* through the gateway of one node: topics are created, listed, described and destroyed;
  one publish and a pipelined publish of a few thousand events come back from a
  subscription with their payloads at their receipts' offsets; a durable subscription
  acked half-way resumes after the ack; bad calls raise the `squall` error classes;
* on three nodes, with the master node killed (kill -9) under an async publisher (several
  tasks pipelining on one publisher through the gateway): nothing acknowledged is lost,
  i.e. every receipt's offset is readable on the new master with the payload that was
  published, each (publisher_id, sequence) stored once; a following async subscription
  hands the app every acknowledged event once, in offset order, across the kill;
* the replicated proxy moves to the new master and says so (`on_rebind`, `rebound`);
  the non-replicated proxy raises `PublisherLost` instead, and a new one works;
* the master node paused (SIGSTOP) while another is elected, with a receipt timeout far
  longer than the pause: async publishers through the gateway and through a replicated
  proxy (which asks the gateway who the master is when a receipt is late) publish to the
  new master during the pause, nothing acknowledged lost;
* `squall.aio.PushEndpoint` serves push deliveries to a coroutine callback.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from collections.abc import Awaitable, Callable

import pytest

import squall
import squall.aio
from squall.v1 import common_pb2
from tests.integration.conftest import LocalCluster, stored_events

pytestmark = pytest.mark.integration

# Every wait is bounded generously: the machine running the tests is shared.
WAIT_S = 30.0


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls condition on the loop until it holds; fails the test with `what` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.02)


def _by_offset(events: list[common_pb2.Event]) -> dict[int, common_pb2.Event]:
    return {e.offset: e for e in events}


def test_publish_and_read_back_through_the_gateway(shared_single: LocalCluster) -> None:
    async def main() -> None:
        async with squall.aio.connect(shared_single.gateway_address, timeout_s=10.0) as client:
            created = await client.create_topic("orders")
            assert created.name == "orders"
            with pytest.raises(squall.AlreadyExists):
                await client.create_topic("orders")
            with pytest.raises(squall.NotFound):
                await client.topic("missing")
            assert "orders" in [t.name for t in await client.topics()]
            status = await client.status()
            assert status.nodes, status
            topic = await client.topic("orders")

            async with topic.publisher("app-1") as publisher:
                first = await publisher.publish(b"first", key=b"k", headers={"h": "v"})
                events = [b"event %d" % i for i in range(3_000)]
                receipts = await publisher.publish_many(events, batch_events=100)
                assert publisher.next_sequence == 3_002
            assert first.offset == 0 and not first.duplicate
            assert [r.offset for r in receipts] == list(range(1, 3_001))

            # A non-follow subscription reads back everything, payloads at their offsets.
            seen: list[squall.Message] = []
            async with topic.subscribe(follow=False) as subscription:
                async for message in subscription:
                    seen.append(message)
            assert [m.offset for m in seen] == list(range(3_001))
            assert (seen[0].payload, seen[0].key, dict(seen[0].headers)) == (
                b"first",
                b"k",
                {"h": "v"},
            )
            assert [m.payload for m in seen[1:]] == events
            assert {(m.publisher_id, m.sequence) for m in seen} == {
                ("app-1", s) for s in range(1, 3_002)
            }

            # A durable subscription: ack half-way, close, and resume after the ack.
            async with topic.subscribe("billing", follow=False) as billing:
                async for message in billing:
                    if message.offset == 1_500:
                        assert await billing.ack(message) == 1_501
                        break
            assert ("billing", 1_501) in await topic.subscriptions()
            async with topic.subscribe("billing", follow=False) as billing:
                rest = [m.offset async for m in billing]
            assert rest == list(range(1_501, 3_001))
            with pytest.raises(ValueError, match="durable"):
                await topic.subscribe(follow=False).ack(0)
            await topic.delete_subscription("billing")

            info = await topic.refresh()
            assert info.name == "orders"
            await client.destroy_topic("orders")
            with pytest.raises(squall.NotFound):
                await topic.refresh()

    asyncio.run(main())


def test_connect_validates_like_the_threaded_client() -> None:
    for kwargs, message in [
        ({"retry_total_ms_max": 0}, "retry_total_ms_max"),
        ({"retry_backoff_initial_ms": 500, "retry_backoff_max_ms": 100}, "backoff_initial_ms"),
        ({"timeout_s": 0}, "timeout_s"),
    ]:
        with pytest.raises(ValueError, match=message):
            squall.connect("127.0.0.1:1", **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=message):
            squall.aio.connect("127.0.0.1:1", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="address"):
        squall.aio.connect("")


class _AsyncApp:
    """Tasks publishing through one async publisher, remembering every receipt they got."""

    def __init__(self, publisher: squall.aio.Publisher, tasks: int = 4) -> None:
        self.publisher = publisher
        self.tasks = tasks
        self.stop = False
        # payload -> receipt, for every publish the app saw succeed (publish,
        # publish_many and publish_async in turn).
        self.acked: dict[bytes, squall.Receipt] = {}
        self.failed: list[BaseException] = []

    def acked_by(self, master_id: str) -> int:
        return sum(r.master_id == master_id for r in self.acked.values())

    async def _task(self, number: int) -> None:
        for round_ in range(100_000):  # bounded; the test stops it much earlier
            if self.stop:
                return
            payloads = [b"t%d-r%d-e%d" % (number, round_, i) for i in range(20)]
            try:
                if round_ % 3 == 1:
                    receipts = [await self.publisher.publish(payloads[0])]
                    payloads = payloads[:1]
                elif round_ % 3 == 2:
                    # Queued one by one, batched by the publisher, retried by its task.
                    futures = [await self.publisher.publish_async(p) for p in payloads]
                    outcomes = await asyncio.gather(*futures, return_exceptions=True)
                    for payload, outcome in zip(payloads, outcomes, strict=True):
                        if isinstance(outcome, squall.Receipt):
                            self.acked[payload] = outcome
                        else:
                            self.failed.append(outcome)
                    continue
                else:
                    receipts = await self.publisher.publish_many(payloads, batch_events=5)
            except squall.SquallError as error:
                self.failed.append(error)
                continue
            self.acked.update(zip(payloads, receipts, strict=True))

    async def run(self) -> None:
        await asyncio.gather(*(self._task(n) for n in range(self.tasks)))


async def _kill_master_under(
    trio: LocalCluster, app: _AsyncApp, also: Callable[[], Awaitable[None]] | None = None
) -> tuple[str, str]:
    """Runs the app across a kill -9 of the master node; returns (old, new master)."""
    old = await asyncio.to_thread(trio.wait_for_master)
    running = asyncio.create_task(app.run())
    try:
        await _until(lambda: app.acked_by(old) >= 100, WAIT_S, f"100 acks from {old}")
        await asyncio.to_thread(trio.kill_node, old)
        new = await asyncio.to_thread(trio.wait_for_master, WAIT_S, old)
        await _until(lambda: app.acked_by(new) >= 100, WAIT_S, f"100 acks from {new}")
    finally:
        app.stop = True
        await asyncio.wait_for(running, WAIT_S)
    if also is not None:
        await also()
    return old, new


def _check_nothing_acknowledged_lost(
    trio: LocalCluster, new: str, topic: str, app: _AsyncApp, publisher_id: str
) -> list[common_pb2.Event]:
    """Every receipt's offset holds, on the new master, the payload that was published;
    every (publisher_id, sequence) is stored once."""
    events = stored_events(trio, new, topic)
    at = _by_offset(events)
    wrong = [
        (payload, receipt.offset)
        for payload, receipt in app.acked.items()
        if receipt.offset not in at or at[receipt.offset].payload != payload
    ]
    assert not wrong, f"acknowledged but not readable at the receipt's offset: {wrong[:10]}"
    counts = collections.Counter((e.publisher_id, e.sequence) for e in events)
    assert not [k for k, n in counts.items() if n > 1], "a sequence was stored twice"
    assert publisher_id in {e.publisher_id for e in events}
    return events


def test_master_kill_under_an_async_publisher_loses_nothing_acknowledged(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    trio.start_all()

    async def main() -> None:
        async with squall.aio.connect(trio.gateway_address, timeout_s=5.0) as client:
            await client.create_topic("orders")
            topic = await client.topic("orders")
            delivered: list[squall.Message] = []
            subscription = topic.subscribe(follow=True)

            async def follow() -> None:
                async for message in subscription:
                    delivered.append(message)

            follower = asyncio.create_task(follow())
            async with topic.publisher("app-1") as publisher:
                app = _AsyncApp(publisher)
                _old, new = await _kill_master_under(trio, app)
            assert len(app.acked) >= 200
            # The retry budget (10 s) outlasts the failover: no error reached the app.
            assert not app.failed, app.failed[:3]
            events = _check_nothing_acknowledged_lost(trio, new, "orders", app, "app-1")
            # The following subscription saw every stored event once, in offset order.
            last = events[-1].offset
            await _until(
                lambda: bool(delivered) and delivered[-1].offset >= last,
                WAIT_S,
                f"the follower reaching offset {last}",
            )
            await subscription.close()
            await asyncio.wait_for(follower, WAIT_S)
            offsets = [m.offset for m in delivered]
            assert offsets == sorted(set(offsets)), "a duplicate or out of order delivery"
            assert {m.offset for m in delivered} >= {r.offset for r in app.acked.values()}
            assert [m.payload for m in delivered if m.offset <= last] == [e.payload for e in events]

    asyncio.run(main())


def test_replicated_proxy_moves_to_the_new_master_and_says_so(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    trio.start_all()

    async def main() -> None:
        moves: list[tuple[squall.Endpoint, squall.Endpoint]] = []
        async with squall.aio.connect(trio.gateway_address, timeout_s=5.0) as client:
            await client.create_topic("orders")
            topic = await client.topic("orders")
            publisher = await topic.publisher(
                "app-1", replicated=True, on_rebind=lambda old, new: moves.append((old, new))
            )
            app = _AsyncApp(publisher)
            old, new = await _kill_master_under(trio, app)
            assert publisher.endpoint is not None and publisher.endpoint.node_id == new
            await publisher.close()
        assert [(a.node_id, b.node_id) for a, b in moves] == [(old, new)]
        assert sum(r.rebound for r in app.acked.values()) == 1
        assert not app.failed, app.failed[:3]  # a replicated proxy moves silently
        _check_nothing_acknowledged_lost(trio, new, "orders", app, "app-1")

    asyncio.run(main())


def test_non_replicated_proxy_raises_publisher_lost_and_a_new_one_works(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    trio.start_all()

    async def main() -> None:
        old = await asyncio.to_thread(trio.wait_for_master)
        async with squall.aio.connect(trio.gateway_address, timeout_s=5.0) as client:
            await client.create_topic("ledger")
            topic = await client.topic("ledger")
            publisher = await topic.publisher("app-1", replicated=False)
            assert not publisher.replicated
            assert (await publisher.publish(b"1")).master_id == old
            await asyncio.to_thread(trio.kill_node, old)
            lost_sequence = 0
            for sequence in range(2, 1000):  # bounded: the first publish after the kill fails
                try:
                    await publisher.publish(b"%d" % sequence)
                except squall.PublisherLost:
                    lost_sequence = sequence
                    break
            assert lost_sequence, "a non-replicated publisher moved silently"
            with pytest.raises(squall.PublisherLost):
                await publisher.publish(b"again")  # lost for good
            await publisher.close()
            new = await asyncio.to_thread(trio.wait_for_master, WAIT_S, old)
            # The lost event may be stored; resending it under the same id and sequence
            # is safe.
            async with topic.publisher(
                "app-1", replicated=False, start_sequence=lost_sequence
            ) as fresh:
                receipts = [
                    await fresh.publish(b"%d" % s) for s in range(lost_sequence, lost_sequence + 5)
                ]
        assert {r.master_id for r in receipts} == {new}
        events = stored_events(trio, new, "ledger")
        stored = collections.Counter((e.publisher_id, e.sequence) for e in events)
        assert all(count == 1 for count in stored.values()), stored
        assert {s for _, s in stored} == set(range(1, lost_sequence + 5))
        at = _by_offset(events)
        assert [at[r.offset].payload for r in receipts] == [
            b"%d" % s for s in range(lost_sequence, lost_sequence + 5)
        ]

    asyncio.run(main())


def test_push_endpoint_on_the_event_loop_receives_every_event_in_order(
    shared_single: LocalCluster,
) -> None:
    async def main() -> None:
        deliveries: list[squall.PushDelivery] = []
        failures = 0

        async def handle(delivery: squall.PushDelivery) -> None:
            nonlocal failures
            if failures == 0:
                failures += 1
                raise RuntimeError("down once")  # the master retries (retry_count=-1)
            deliveries.append(delivery)

        async with (
            squall.aio.PushEndpoint() as endpoint,
            squall.aio.connect(shared_single.gateway_address) as client,
        ):
            await client.create_topic("pushed")
            topic = await client.topic("pushed")
            info = await topic.subscribe_push(
                "billing",
                endpoint,
                reliability="ordered",
                retry_count=-1,
                start="earliest",
                on_delivery=handle,
            )
            assert (info.subscriber_id, info.ordered) == ("billing", True)
            with pytest.raises(squall.AlreadySubscribed):
                await topic.subscribe_push("billing", endpoint)
            async with topic.publisher() as publisher:
                receipts = await publisher.publish_many([b"%d" % i for i in range(200)])
            last = receipts[-1].offset
            await _until(
                lambda: any(m.offset == last for d in deliveries for m in d.messages),
                WAIT_S,
                "every event pushed",
            )
            assert [s.subscriber_id for s in await topic.push_subscribers()] == ["billing"]
            await topic.unsubscribe_push("billing")
            assert await topic.push_subscribers() == []
        offsets = [m.offset for d in deliveries for m in d.messages]
        # Ordered: each batch follows the last one handled; the failed one came again.
        assert offsets == list(range(200))
        assert [m.payload for d in deliveries for m in d.messages] == [
            b"%d" % i for i in range(200)
        ]
        assert failures == 1

    asyncio.run(main())


def test_async_publishers_move_to_the_new_master_while_the_old_one_is_paused(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    trio.start_all()
    pause_s = 20.0  # longer than any failover here, far shorter than the receipt timeout

    async def main() -> None:
        old = await asyncio.to_thread(trio.wait_for_master)
        pids = [trio.services[(kind, old)].process.pid for kind in ("coordinator", "replica")]
        async with squall.aio.connect(trio.gateway_address, timeout_s=120.0) as client:
            await client.create_topic("paused")
            topic = await client.topic("paused")
            apps = [
                _AsyncApp(await topic.publisher("gateway"), tasks=2),
                _AsyncApp(await topic.publisher("replicated", replicated=True), tasks=2),
            ]
            running = [asyncio.create_task(app.run()) for app in apps]
            try:
                await _until(
                    lambda: all(a.acked_by(old) >= 50 for a in apps), WAIT_S, "acks before"
                )
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    new = await asyncio.to_thread(trio.wait_for_master, pause_s, old)
                    await _until(
                        lambda: all(a.acked_by(new) >= 50 for a in apps),
                        pause_s,
                        f"both publishers acknowledged by {new} during the pause",
                    )
                finally:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
            finally:
                for app in apps:
                    app.stop = True
                await asyncio.wait_for(asyncio.gather(*running), 150.0)
                for app in apps:
                    await app.publisher.close()
        assert all(not app.failed for app in apps), [app.failed[:3] for app in apps]
        for app in apps:
            _check_nothing_acknowledged_lost(trio, new, "paused", app, app.publisher.publisher_id)

    asyncio.run(main())
