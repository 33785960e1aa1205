"""Shared subscriptions on a real three-node cluster, across a kill -9 of the master (issue 18
items 1, 5, 7).

Goal: three consumers share one subscription while the master is killed: every event is
acknowledged successfully exactly once (by whichever consumer acked it), none is lost,
the poison events a consumer always nacks end in the dead-letter topic after
max_deliveries with their delivery count and last error as headers, once each; bad
settings are refused with a status naming the problem and create nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading

import pytest

import squall
import squall.aio
from squall.v1 import broker_pb2
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_gateway import trio  # noqa: F401  (the fixture)

EVENTS = 60
POISON = {7, 27, 47}


def test_consumers_share_work_across_a_master_kill_and_poison_is_dead_lettered(
    trio: LocalCluster,  # noqa: F811
) -> None:
    gateway = trio.gateway_address
    with squall.connect(gateway, timeout_s=5.0) as client:
        client.create_topic("work")
        client.create_topic("work-dlq")
        topic = client.topic("work")
        # Bad settings: refused, naming the problem; nothing is created.
        with pytest.raises(squall.InvalidArgument, match="max_deliveries"):
            client._call(  # the library checks this itself; the server must too
                client._subscriber_stub.CreateSharedSubscription,
                broker_pb2.CreateSharedSubscriptionRequest(
                    topic="work", subscription="workers", ack_deadline_ms=1000, max_deliveries=0
                ),
            )
        with pytest.raises(squall.NotFound, match="dead-letter topic 'nope'"):
            topic.create_shared_subscription("workers", dead_letter_topic="nope")
        with pytest.raises(squall.InvalidArgument, match="own topic"):
            topic.create_shared_subscription("workers", dead_letter_topic="work")
        assert topic.subscription_infos() == []

        assert topic.create_shared_subscription(
            "workers", ack_deadline_ms=3_000, max_deliveries=2, dead_letter_topic="work-dlq"
        )
        assert not topic.create_shared_subscription(  # the same settings again: ok
            "workers", ack_deadline_ms=3_000, max_deliveries=2, dead_letter_topic="work-dlq"
        )
        with topic.publisher("producer") as publisher:
            publisher.publish_many(
                [(None, b"poison" if i in POISON else b"job %d" % i) for i in range(EVENTS)]
            )

        lock = threading.Lock()
        acked: list[tuple[str, int]] = []  # (consumer, offset) of every ack that succeeded
        errors: list[BaseException] = []
        stop = threading.Event()

        def consume(consumer: squall.SharedConsumer) -> None:
            try:
                while not stop.is_set():
                    for message in consumer.pull(max_messages=4, wait_ms=500):
                        if message.payload == b"poison":
                            # A nack that fails lets the lease lapse: delivered again.
                            with contextlib.suppress(squall.SquallError):
                                message.nack(error="poison")
                            continue
                        try:
                            message.ack()
                        except squall.FailedPrecondition:
                            continue  # leased to or acked by another consumer meanwhile
                        with lock:
                            acked.append((consumer.consumer_id, message.offset))
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        consumers = [topic.shared("workers", consumer_id=f"c{i}") for i in range(3)]
        threads = [threading.Thread(target=consume, args=(c,), daemon=True) for c in consumers]
        for thread in threads:
            thread.start()

        def done() -> set[int]:
            with lock:
                return {offset for _, offset in acked}

        wait_for(lambda: len(done()) >= 15 or errors, 20, "the first acks")
        old = trio.wait_for_master()
        trio.kill_node(old)
        trio.wait_for_master(exclude=old)
        expected = set(range(EVENTS)) - POISON
        wait_for(lambda: done() >= expected or errors, 40, "every event acked after the kill")
        stop.set()
        for thread in threads:
            thread.join(10)
        assert not errors, repr(errors[0])

        counts = collections.Counter(offset for _, offset in acked)
        assert set(counts) == expected
        assert [o for o, n in counts.items() if n != 1] == [], "an event acked twice"
        assert len({c for c, _ in acked}) >= 2, "the work was not shared"

        def letters() -> list[squall.Message]:
            return list(client.topic("work-dlq").subscribe(None, follow=False))

        wait_for(lambda: len(letters()) >= len(POISON), 20, "the dead letters")
        dead = letters()
        assert sorted(int(m.headers["squall-dead-letter-offset"]) for m in dead) == sorted(POISON)
        for m in dead:
            assert m.payload == b"poison"
            assert m.headers["squall-dead-letter-deliveries"] == "2"
            # A nack lost in the failover lets the lease lapse instead.
            last_error = m.headers["squall-dead-letter-last-error"]
            assert last_error == "poison" or last_error.startswith("ack deadline passed")
            assert m.headers["squall-dead-letter-subscription"] == "workers"
        wait_for(
            lambda: topic.subscription_info("workers").cursor == EVENTS, 20, "the floor at the end"
        )
        info = topic.subscription_info("workers")
        assert info.shared and info.dead_lettered == len(POISON) and info.backlog == 0
        described = run_squall("subscription", "info", "work", "workers", "--gateway", gateway)
        assert described.returncode == 0, described.stderr
        assert "dead_lettered\t3" in described.stdout, described.stdout


def test_the_cli_and_the_asyncio_client_consume_a_shared_subscription(
    single: LocalCluster,
) -> None:
    gateway = single.gateway_address
    with squall.connect(gateway, timeout_s=10.0) as client:
        client.create_topic("jobs")
        client.create_topic("jobs-dlq")
        with client.topic("jobs").publisher("app") as publisher:
            publisher.publish_many([(None, b"job %d" % i) for i in range(6)])
    printed = run_squall(
        "subscribe", "jobs", "--shared", "w", "--count", "2", "--max-deliveries", "1",
        "--dead-letter-topic", "jobs-dlq", "--gateway", gateway,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    assert [line.split("\t")[0] for line in printed.stdout.splitlines()] == ["0", "1"]

    async def main() -> None:
        async with squall.aio.connect(gateway, timeout_s=10.0) as client:
            topic = await client.topic("jobs")
            # A plain read or ack of a shared subscription is refused, naming Pull.
            with pytest.raises(squall.FailedPrecondition, match="is shared"):
                async with topic.subscribe("w", follow=False) as plain:
                    async for _ in plain:
                        pass
            async with topic.shared("w", consumer_id="a") as consumer:
                messages = await consumer.pull(max_messages=10, wait_ms=2_000)
                assert [m.offset for m in messages] == [2, 3, 4, 5]
                info = await topic.subscription_info("w")
                assert info.shared and info.outstanding == 4 and info.cursor == 2
                other = topic.shared("w", consumer_id="b")
                with pytest.raises(squall.FailedPrecondition, match="consumer 'a' does"):
                    await other._settle(messages[0], True, 0, "")
                assert await messages[0].extend(60_000) > messages[0].deadline_ms
                await messages[1].nack(error="bad job")  # max_deliveries 1: dead-lettered
                for message in (messages[0], messages[2], messages[3]):
                    await message.ack()
                assert await consumer.pull(max_messages=10, wait_ms=200) == []

            # Flow control: at most max_outstanding events held, max_outstanding_bytes of them.
            assert await topic.create_shared_subscription("flow")
            limited = topic.shared("flow", consumer_id="f", max_outstanding=2)
            two = await limited.pull(max_messages=10, wait_ms=2_000)
            assert [m.offset for m in two] == [0, 1]
            assert await limited.pull(max_messages=10, wait_ms=0) == []
            await two[0].ack()
            assert [m.offset for m in await limited.pull(max_messages=10, wait_ms=0)] == [2]
            assert await topic.create_shared_subscription("bytes")
            small = topic.shared("bytes", consumer_id="s", max_outstanding_bytes=12)
            first_two = await small.pull(max_messages=10, wait_ms=2_000)  # 5 bytes each
            assert [m.offset for m in first_two] == [0, 1]

            # Exclusive mode: one consumer at a time, in order; a silent one is taken over.
            assert await topic.create_shared_subscription(
                "ordered", ack_deadline_ms=5_000, exclusive=True, exclusive_takeover_ms=500
            )
            first, second = (
                topic.shared("ordered", consumer_id="a"),
                topic.shared("ordered", consumer_id="b"),
            )
            held = await first.pull(max_messages=3, wait_ms=2_000)
            assert [m.offset for m in held] == [0, 1, 2]
            assert await second.pull(wait_ms=0) == []
            for message in held:
                await message.ack()
            # "a" stops pulling: after the takeover time "b" gets the rest, from the floor.
            taken: list[int] = []
            for _ in range(40):  # bounded: 40 pulls of up to 250 ms
                taken = [m.offset for m in await second.pull(max_messages=10, wait_ms=250)]
                if taken:
                    break
            assert taken == [3, 4, 5]
            assert await first.pull(wait_ms=0) == []

    asyncio.run(main())
    described = run_squall("subscription", "info", "jobs", "w", "--gateway", gateway)
    assert described.returncode == 0, described.stderr
    assert "cursor\t6" in described.stdout and "dead_lettered\t1" in described.stdout
    with squall.connect(gateway, timeout_s=10.0) as client:
        (letter,) = list(client.topic("jobs-dlq").subscribe(None, follow=False))
        assert letter.payload == b"job 3"
        assert letter.headers["squall-dead-letter-last-error"] == "bad job"
        assert letter.headers["squall-dead-letter-deliveries"] == "1"


def test_a_long_pull_waits_as_asked_through_the_gateway_and_answers_before_its_deadline(
    cluster_factory: object,
) -> None:
    """A Pull waits up to its wait_ms for work and then answers, empty, as the contract
    says, also when that wait is longer than the gateway's deadline for a forwarded call
    (timeouts.publish_timeout_ms, 2 s here, 10 s by default), which used to cut it short
    with DEADLINE_EXCEEDED, and when the caller's own deadline is shorter than the wait,
    which it now answers before. The library's call covers the wait it asks for: its
    consumer gets the event published meanwhile, as its first delivery."""
    single = cluster_factory("single.toml", timeouts={"publish_timeout_ms": 2000})  # type: ignore[operator]
    assert isinstance(single, LocalCluster)
    single.start_all()
    with squall.connect(single.gateway_address, timeout_s=2.0) as client:
        client.create_topic("jobs")
        topic = client.topic("jobs")
        topic.create_shared_subscription("w", ack_deadline_ms=60_000, max_deliveries=3)

        def pull(wait_ms: int, timeout_s: float) -> list[broker_pb2.SharedMessage]:
            request = broker_pb2.PullRequest(
                topic="jobs", subscription="w", consumer_id="raw", max_messages=1, wait_ms=wait_ms
            )
            return list(client._subscriber_stub.Pull(request, timeout=timeout_s).messages)

        assert pull(wait_ms=4_000, timeout_s=6.0) == []
        assert pull(wait_ms=5_000, timeout_s=1.0) == []

        def publish(payload: bytes) -> None:
            with topic.publisher() as publisher:
                publisher.publish(payload)

        publish_later = threading.Timer(3.0, publish, args=(b"late job",))
        publish_later.start()
        try:
            with topic.shared("w", consumer_id="c1", wait_ms=4_000) as consumer:
                got = consumer.pull()
        finally:
            publish_later.join()
        assert [(m.payload, m.delivery_attempt) for m in got] == [(b"late job", 1)]

        async def aio_pull() -> list[tuple[bytes, int]]:
            async with squall.aio.connect(single.gateway_address, timeout_s=2.0) as aio_client:
                aio_topic = await aio_client.topic("jobs")
                async with aio_topic.shared("w", consumer_id="c2", wait_ms=4_000) as consumer:
                    return [(m.payload, m.delivery_attempt) for m in await consumer.pull()]

        publish_later = threading.Timer(3.0, publish, args=(b"later job",))
        publish_later.start()
        try:
            assert asyncio.run(aio_pull()) == [(b"later job", 1)]
        finally:
            publish_later.join()
