"""Seek on a real three-node cluster, across a kill -9 of the master (issue 18 items 2, 7).

Goal: `squall subscription seek --time` moves a durable subscription back to the first
event at or after the time; the app reading it is given those events again at once; an
ack of a message delivered before the seek is refused and changes nothing; the seek is
replicated (after the master is killed the new master has the same cursor and generation)
and the reader goes on to every event acknowledged after the kill; a time in the future is
refused by the CLI with a message naming it, and a time before the first event is clamped
and says so.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import threading
import time

import pytest

import squall
import squall.aio
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_gateway import trio  # noqa: F401  (the fixture)


def _iso(timestamp_ms: int) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp_ms / 1000, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_seek_by_time_replays_from_there_and_survives_a_master_kill(
    trio: LocalCluster,  # noqa: F811
) -> None:
    gateway = trio.gateway_address
    with squall.connect(gateway, timeout_s=5.0) as client:
        client.create_topic("ledger")
        topic = client.topic("ledger")
        with topic.publisher("seed") as publisher:
            publisher.publish_many([(None, b"first %d" % i) for i in range(10)])
            time.sleep(0.2)  # the second batch gets a later timestamp on the master
            publisher.publish_many([(None, b"second %d" % i) for i in range(10)])
        stored = list(topic.subscribe(None, follow=False))
        boundary_ms = stored[10].timestamp_ms
        assert stored[9].timestamp_ms < boundary_ms

        subscription = topic.subscribe("audit", follow=True)
        delivered: list[squall.Message] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                for message in subscription:
                    with lock:
                        delivered.append(message)
                    try:
                        subscription.ack(message)
                    except (squall.Aborted, squall.Unavailable, squall.Indeterminate):
                        pass  # a seek or the failover won: the message comes again
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()

        def counts() -> collections.Counter[int]:
            with lock:
                return collections.Counter(m.offset for m in delivered)

        wait_for(lambda: len(counts()) == 20 or errors, 20, "the reader read all 20")
        wait_for(lambda: topic.subscription_info("audit").cursor == 20, 20, "all acked")
        with lock:
            stale = delivered[-1]

        moved = run_squall(
            "subscription", "seek", "ledger", "audit", "--time", _iso(boundary_ms),
            "--gateway", gateway,
        )  # fmt: skip
        assert moved.returncode == 0, moved.stderr
        assert "cursor 10 (was 20)" in moved.stdout, moved.stdout
        generation = topic.subscription_info("audit").seek_generation
        assert generation > 0
        # The reader is handed offsets 10-19 again, from the new cursor, without waiting.
        wait_for(lambda: all(counts()[o] == 2 for o in range(10, 20)) or errors, 20, "the replay")
        assert all(counts()[o] == 1 for o in range(10)), "the seek replayed too much"
        # An ack of a message delivered before the seek cannot undo it.
        with pytest.raises(squall.Aborted, match="moved by a seek"):
            subscription.ack(stale)

        old = trio.wait_for_master()
        trio.kill_node(old)
        trio.wait_for_master(exclude=old)
        with topic.publisher("after") as publisher:
            receipts = publisher.publish_many([(None, b"after %d" % i) for i in range(10)])
        acked = {r.offset for r in receipts}
        wait_for(lambda: acked <= set(counts()) or errors, 30, "events acked after the kill")
        assert not errors, repr(errors[0])

        # The new master holds the seek (its generation is the seek's log entry).
        info = topic.subscription_info("audit")
        assert info.seek_generation == generation
        described = run_squall("subscription", "info", "ledger", "audit", "--gateway", gateway)
        assert described.returncode == 0, described.stderr
        assert f"seek_generation\t{generation}" in described.stdout

        # A time in the future is refused and changes nothing; one before the first event
        # is clamped to it, and the answer says so.
        future = run_squall(
            "subscription", "seek", "ledger", "audit", "--time", "2999-01-01T00:00:00Z",
            "--gateway", gateway,
        )  # fmt: skip
        assert future.returncode == 1 and "in the future" in future.stderr, future.stderr
        assert topic.subscription_info("audit").seek_generation == generation
        early = topic.seek("audit", datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        assert early.clamped and early.cursor == 0 and "before the oldest event" in early.note
        subscription.close()
        reader.join(10)


def test_the_asyncio_client_seeks_replays_and_fences_stale_acks(single: LocalCluster) -> None:
    async def main() -> None:
        async with squall.aio.connect(single.gateway_address, timeout_s=10.0) as client:
            await client.create_topic("jobs")
            topic = await client.topic("jobs")
            async with topic.publisher("app") as publisher:
                await publisher.publish_many([b"job %d" % i for i in range(6)])
            async with topic.subscribe("workers", follow=True) as subscription:
                seen: list[squall.Message] = []
                async for message in subscription:
                    seen.append(message)
                    await subscription.ack(message)
                    if message.offset == 5:
                        break
                moved = await topic.seek("workers", 2)
                assert (moved.cursor, moved.previous_cursor, moved.clamped) == (2, 6, False)
                # The open stream ends (ABORTED) and starts again at offset 2 by itself.
                replay = [await asyncio.wait_for(anext(subscription), 20) for _ in range(4)]
                assert [m.offset for m in replay] == [2, 3, 4, 5]
                assert subscription.reconnects == 1
                with pytest.raises(squall.Aborted):
                    await subscription.ack(seen[-1])  # delivered before the seek
                assert await subscription.ack(replay[-1]) == 6
            info = await topic.subscription_info("workers")
            assert (info.cursor, info.backlog, info.seek_generation) == (
                6,
                0,
                moved.seek_generation,
            )
            with pytest.raises(squall.InvalidArgument, match="beyond the end"):
                await topic.seek("workers", 99)
            with pytest.raises(squall.NotFound):
                await topic.subscription_info("nobody")

    asyncio.run(main())
