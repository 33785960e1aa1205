"""The asyncio client (`squall.aio`) against the fake brokers of the threaded client's tests.

Goal: the same semantics as `squall`: topics and errors; publish and pipelined
publish_many with receipts in input order and sequences on the wire in order even from
several tasks at once; a lost answer (the stream ends UNAVAILABLE/UNKNOWN/DEADLINE after
the broker stored the batch) is resent with the same (publisher_id, sequence) and stored
once; a definite refusal is raised at once; `Indeterminate` comes only when the *time*
budget ran out (a fake clock: far more than 16 attempts), and a definite answer after a
lost one is still `Indeterminate`; subscriptions iterate, ack, and reconnect after a
broken stream without handing the app a duplicate; the replicated proxy fails over,
reports the move and follows a slave's redirect, the non-replicated one raises
`PublisherLost` (with `maybe_stored` as the attempt left it) and a new one works.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator

import grpc
import pytest

import squall
import squall.aio
from squall._proxy import GatewayBinding, ProxyBinding
from squall._publish_rules import status_lost_trailing
from squall.v1 import broker_pb2, broker_pb2_grpc
from tests.unit.test_client import FakeBroker, serve_fake
from tests.unit.test_client_failover import _Cluster
from tests.unit.test_client_retry import FAST, FlakyBroker


@pytest.fixture
def flaky() -> Iterator[FlakyBroker]:
    fake = FlakyBroker()
    server, address = serve_fake(fake)
    fake.address = address  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        server.stop(grace=None)


def _connect(broker: FakeBroker, **retry: int) -> squall.aio.Opening[squall.aio.Client]:
    address: str = broker.address  # type: ignore[attr-defined]
    return squall.aio.connect(address, timeout_s=5.0, **{**FAST, **retry})


def _stored(broker: FakeBroker, topic: str = "t") -> collections.Counter[tuple[str, int]]:
    with broker.cond:
        events = list(broker.topics[topic].events)
    return collections.Counter((e.publisher_id, e.sequence) for e in events)


def test_topics_and_errors(flaky: FlakyBroker) -> None:
    async def main() -> None:
        client = await _connect(flaky)
        try:
            assert (await client.create_topic("t")).name == "t"
            with pytest.raises(squall.AlreadyExists):
                await client.create_topic("t")
            assert [t.name for t in await client.topics()] == ["t"]
            assert (await client.topic("t")).name == "t"
            await client.destroy_topic("t")
            with pytest.raises(squall.NotFound):
                await client.topic("t")
        finally:
            await client.close()
        with pytest.raises(ValueError, match="closed"):
            await client.topics()

    asyncio.run(main())


def test_publish_many_from_several_tasks_keeps_sequences_in_wire_order(
    flaky: FlakyBroker,
) -> None:
    async def main() -> list[list[squall.Receipt]]:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p", inflight_batches_max=3) as publisher:
                batches = [[b"t%d-%d" % (t, i) for i in range(40)] for t in range(5)]
                return list(
                    await asyncio.gather(
                        *(publisher.publish_many(b, batch_events=7) for b in batches)
                    )
                )

    results = asyncio.run(main())
    events = flaky.topics["t"].events
    # Stored in sequence order (the wire order), each receipt at its own payload.
    assert [e.sequence for e in events] == list(range(1, 201))
    for t, receipts in enumerate(results):
        assert [events[r.offset].payload for r in receipts] == [
            b"t%d-%d" % (t, i) for i in range(40)
        ]


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED],
)
def test_lost_answers_are_retried_and_stored_once(
    flaky: FlakyBroker, code: grpc.StatusCode
) -> None:
    flaky.lose_answers, flaky.lose_code = 3, code
    payloads = [b"e%d" % i for i in range(50)]

    async def main() -> tuple[squall.Receipt, list[squall.Receipt], int]:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p") as publisher:
                one = await publisher.publish(b"once")
                many = await publisher.publish_many(payloads, batch_events=5)
                return one, many, publisher.resends

    one, many, resends = asyncio.run(main())
    assert resends == 3
    assert (one.offset, one.duplicate) == (0, True)
    assert _stored(flaky) == {("p", s): 1 for s in range(1, 52)}
    events = flaky.topics["t"].events
    assert [events[r.offset].payload for r in many] == payloads


def test_definite_failure_is_raised_at_once_and_not_retried(flaky: FlakyBroker) -> None:
    flaky.refusals, flaky.refuse_code = 1, grpc.StatusCode.FAILED_PRECONDITION

    async def main() -> None:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p") as publisher:
                with pytest.raises(squall.FailedPrecondition) as err:
                    await publisher.publish(b"refused")
                assert not err.value.maybe_stored
                assert publisher.resends == 0
                assert (await publisher.publish(b"after")).offset == 0

    asyncio.run(main())
    assert _stored(flaky) == {("p", 2): 1}


def test_definite_answer_after_a_lost_one_is_still_indeterminate(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 1
    flaky.refuse_from_stream = 2

    async def main() -> None:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p") as publisher:
                with pytest.raises(squall.Indeterminate) as err:
                    await publisher.publish(b"stored")
                assert publisher.resends == 1
        assert isinstance(err.value.__cause__, squall.FailedPrecondition)
        assert "an earlier attempt may have stored the events" in err.value.details

    asyncio.run(main())
    assert _stored(flaky) == {("p", 1): 1}


def test_publish_async_retries_lost_batches_and_every_future_succeeds(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 2

    async def main() -> list[squall.Receipt]:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p", inflight_batches_max=2) as publisher:
                futures = [await publisher.publish_async(b"a%d" % i) for i in range(200)]
                await publisher.flush()
                assert all(f.done() for f in futures)
                # Events queued while the window was full went out batched.
                assert flaky.requests_seen < 200
                return [f.result() for f in futures]

    receipts = asyncio.run(main())
    assert len({r.offset for r in receipts}) == 200
    assert _stored(flaky) == {("p", s): 1 for s in range(1, 201)}
    events = flaky.topics["t"].events
    assert [events[r.offset].payload for r in receipts] == [b"a%d" % i for i in range(200)]


def test_tasks_publishing_one_at_a_time_share_requests_and_survive_a_lost_answer(
    flaky: FlakyBroker,
) -> None:
    # 100 tasks each awaiting publish() on one publisher with a two-request window: the
    # events that wait for a slot go out together; a lost answer is retried, stored once.
    flaky.lose_answers = 1

    async def main() -> list[squall.Receipt]:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p", inflight_batches_max=2) as publisher:
                return list(
                    await asyncio.gather(*(publisher.publish(b"c%d" % i) for i in range(100)))
                )

    receipts = asyncio.run(main())
    assert flaky.requests_seen < 50
    assert _stored(flaky) == {("p", s): 1 for s in range(1, 101)}
    events = flaky.topics["t"].events
    assert [events[r.offset].payload for r in receipts] == [b"c%d" % i for i in range(100)]


def test_events_buffered_when_the_stream_broke_are_sent_on_the_next(flaky: FlakyBroker) -> None:
    # A one-batch window: while the first batch waits, later events queue in the buffer;
    # the stream ends, and the buffer goes out on a fresh stream instead of failing.
    flaky.lose_answers = 1

    async def main() -> None:
        async with _connect(flaky) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p", inflight_batches_max=1) as publisher:
                futures = [await publisher.publish_async(b"b%d" % i) for i in range(50)]
                # Mixed with publish_many: its sequences follow the buffered ones.
                receipts = await publisher.publish_many([b"m%d" % i for i in range(10)])
                results = await asyncio.gather(*futures)
                assert len(results) == 50 and len(receipts) == 10

    asyncio.run(main())
    assert _stored(flaky) == {("p", s): 1 for s in range(1, 61)}


class _FakeClock:
    """The retry budget's clock: it moves only when the publisher sleeps between retries."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.now_s += seconds


def _fake_clock_publisher(
    broker: FakeBroker, channel: grpc.aio.Channel, clock: _FakeClock, policy: squall.RetryPolicy
) -> squall.aio.Publisher:
    return squall.aio.Publisher(
        GatewayBinding(broker_pb2_grpc.PublisherStub(channel)),
        "t",
        "p",
        retry=policy,
        monotonic=clock.monotonic,
        sleep=clock.sleep,
    )


def test_indeterminate_only_after_the_time_budget(flaky: FlakyBroker) -> None:
    # Every answer is lost: retrying goes on until 10 s of (fake) time have passed, far
    # beyond the 16 attempts the old budget allowed.
    flaky.lose_answers = 100_000
    clock = _FakeClock()

    async def main() -> int:
        async with _connect(flaky) as client:
            await client.create_topic("t")
        async with grpc.aio.insecure_channel(flaky.address) as channel:  # type: ignore[attr-defined]
            publisher = _fake_clock_publisher(flaky, channel, clock, squall.RetryPolicy())
            with pytest.raises(squall.Indeterminate) as err:
                await publisher.publish(b"lost")
            assert err.value.maybe_stored
            return publisher.resends

    resends = asyncio.run(main())
    assert squall.RETRY_TOTAL_MS_MAX_DEFAULT / 1000 <= clock.now_s
    assert clock.now_s < squall.RETRY_TOTAL_MS_MAX_DEFAULT / 1000 + 0.25
    assert resends > 16
    assert _stored(flaky) == {("p", 1): 1}


def test_a_publish_outlasting_many_attempts_succeeds_within_the_budget(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 40
    clock = _FakeClock()

    async def main() -> tuple[squall.Receipt, int]:
        async with _connect(flaky) as client:
            await client.create_topic("t")
        async with grpc.aio.insecure_channel(flaky.address) as channel:  # type: ignore[attr-defined]
            policy = squall.RetryPolicy(total_ms_max=60_000)
            publisher = _fake_clock_publisher(flaky, channel, clock, policy)
            receipt = await publisher.publish(b"late")
            return receipt, publisher.resends

    receipt, resends = asyncio.run(main())
    assert resends == 40
    assert (receipt.offset, receipt.duplicate) == (0, True)
    assert _stored(flaky) == {("p", 1): 1}


class _BreakingBroker(FakeBroker):
    """Ends the first Subscribe stream with UNAVAILABLE after one response."""

    def __init__(self) -> None:
        super().__init__()
        self.subscribe_calls = 0

    def Subscribe(
        self, request: broker_pb2.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[broker_pb2.SubscribeResponse]:
        with self.cond:
            self.subscribe_calls += 1
            breaking = self.subscribe_calls == 1
        for answered, response in enumerate(super().Subscribe(request, context)):
            if breaking and answered == 1:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway went away")
            yield response


def test_subscription_iterates_acks_and_resumes_after_a_broken_stream() -> None:
    broker = _BreakingBroker()
    server, address = serve_fake(broker)
    broker.address = address  # type: ignore[attr-defined]

    async def main() -> tuple[list[int], int, int]:
        async with _connect(broker) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p") as publisher:
                await publisher.publish_many([b"%d" % i for i in range(30)])
            subscription = topic.subscribe(follow=False, max_batch_events=10)
            offsets = [m.offset async for m in subscription]
            # A durable subscription: ack moves the cursor the next one starts from.
            async with topic.subscribe("billing", follow=False) as billing:
                async for message in billing:
                    if message.offset == 14:
                        assert await billing.ack(message) == 15
                        break
            async with topic.subscribe("billing", follow=False) as billing:
                first = (await billing.__anext__()).offset
            return offsets, subscription.reconnects, first

    try:
        offsets, reconnects, first = asyncio.run(main())
    finally:
        server.stop(grace=None)
    assert offsets == list(range(30))
    assert reconnects == 1
    assert first == 15


# -- publisher proxies (the threaded client's fake replicas) ------------------------------


@pytest.fixture
def replicas() -> Iterator[_Cluster]:
    made = _Cluster(replicas=3)
    try:
        yield made
    finally:
        made.stop()


def _proxy_client(replicas: _Cluster) -> squall.aio.Opening[squall.aio.Client]:
    return squall.aio.connect(replicas.gateway, timeout_s=5.0, **FAST)


def test_replicated_proxy_fails_over_and_reports_the_move(replicas: _Cluster) -> None:
    moves: list[tuple[squall.Endpoint, squall.Endpoint]] = []
    # Each stream answers 3 requests, then ends with UNAVAILABLE before storing the 4th.
    replicas.broker.break_stream_after = 3

    async def main() -> tuple[list[squall.Receipt], int]:
        async with _proxy_client(replicas) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher(
                "p", replicated=True, on_rebind=lambda old, new: moves.append((old, new))
            ) as publisher:
                receipts = [await publisher.publish(b"%d" % i) for i in range(1, 6)]
                return receipts, publisher.rebinds

    receipts, rebinds = asyncio.run(main())
    assert [r.rebound for r in receipts] == [False, False, False, True, False]
    assert moves == [
        (
            squall.Endpoint("n1", replicas.addresses["n1"]),
            squall.Endpoint("n2", replicas.addresses["n2"]),
        )
    ]
    assert rebinds == 1
    stored = _stored_tokens(replicas.broker)
    assert [(p, s) for p, s, _ in stored] == [("p", s) for s in range(1, 6)]


def test_replicated_proxy_follows_a_slaves_redirect(replicas: _Cluster) -> None:
    n1, n2, n3 = (replicas.addresses[n] for n in ("n1", "n2", "n3"))

    async def main() -> squall.Endpoint | None:
        async with _proxy_client(replicas) as client:
            await client.create_topic("t")
            async with (await client.topic("t")).publisher("p", replicated=True) as publisher:
                # Bound to n1, first in the list it got; n1 is now a slave naming n3 (as
                # the gateway does, were the stall watch to ask), and n2 is next in the list.
                replicas.broker.slave_addresses[n1] = n3
                replicas.broker.endpoints = [("n3", n3), ("n1", n1), ("n2", n2)]
                await publisher.publish(b"x")
                return publisher.endpoint

    bound = asyncio.run(main())
    peers = replicas.broker.publish_peers
    # The redirect wins. n1 may be tried more than once: grpc.aio loses the status of a
    # stream ended while a request is written (grpc/grpc#36066), which proves n1 is up.
    assert (peers[0], peers[-1], n2 in peers) == (n1, n3, False), peers
    assert bound == squall.Endpoint("n3", n3)


def test_a_stream_whose_status_grpc_aio_lost_leaves_the_proxy_on_its_replica() -> None:
    n1, n2 = (squall.Endpoint(f"n{i}", f"127.0.0.1:{i}") for i in (1, 2))
    binding = ProxyBinding([n1, n2], replicated=True, make_channel=grpc.insecure_channel)
    lost = status_lost_trailing(grpc.StatusCode.INTERNAL, "Internal error from Core", ())
    binding.stream_failed(n1, grpc.StatusCode.INTERNAL, lost)
    assert (binding.current(), binding.metadata()) == (n1, ())
    # Any other INTERNAL may come from a replica that is gone: the next stream moves on.
    other = status_lost_trailing(grpc.StatusCode.INTERNAL, "Received RST_STREAM", ())
    binding.stream_failed(n1, grpc.StatusCode.INTERNAL, other)
    assert (binding.current(), binding.metadata()) == (n2, (("squall-unreachable", n1.address),))


def test_non_replicated_proxy_raises_on_master_loss_and_a_new_one_works(
    replicas: _Cluster,
) -> None:
    replicas.broker.break_stream_after = 2

    async def main() -> None:
        async with _proxy_client(replicas) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            publisher = await topic.publisher("p", replicated=False)
            await publisher.publish(b"1")
            await publisher.publish(b"2")
            with pytest.raises(squall.PublisherLost) as lost:
                await publisher.publish(b"3")
            assert lost.value.maybe_stored  # it was sent when the master went
            with pytest.raises(squall.PublisherLost) as again:
                await publisher.publish(b"4")
            assert not again.value.maybe_stored  # never sent
            await publisher.close()
            assert replicas.broker.publish_peers == [replicas.addresses["n1"]]
            replicas.broker.break_stream_after = 0
            async with topic.publisher("p", replicated=False, start_sequence=3) as fresh:
                await fresh.publish(b"3")
            with pytest.raises(ValueError, match="on_rebind"):
                await topic.publisher(on_rebind=lambda old, new: None)

    asyncio.run(main())
    assert [(p, s) for p, s, _ in _stored_tokens(replicas.broker)] == [
        ("p", 1),
        ("p", 2),
        ("p", 3),
    ]


def _stored_tokens(broker: FakeBroker) -> list[tuple[str, int, str]]:
    with broker.cond:
        return [(e.publisher_id, e.sequence, e.session_token) for e in broker.topics["t"].events]


class _TraceBroker(FakeBroker):
    """Remembers the traceparent and authorization each CreateTopic call carried."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[dict[str, str]] = []

    def CreateTopic(
        self, request: broker_pb2.CreateTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.CreateTopicResponse:
        metadata = dict(context.invocation_metadata())
        self.headers.append({k: str(metadata.get(k, "")) for k in ("traceparent", "authorization")})
        return super().CreateTopic(request, context)


def test_calls_are_traced_and_carry_the_token() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    broker = _TraceBroker()
    server, address = serve_fake(broker)

    async def main() -> None:
        async with squall.aio.connect(
            address, tracer_provider=provider, token="s3cret-token-value"
        ) as client:
            await client.create_topic("t")
            await asyncio.sleep(0.05)  # the span ends in a task once the status is read

    try:
        asyncio.run(main())
    finally:
        server.stop(grace=None)
    (span,) = [s for s in exporter.get_finished_spans() if s.name.endswith("CreateTopic")]
    assert span.name == "squall.v1.TopicManager/CreateTopic"
    assert span.attributes is not None and span.attributes["rpc.grpc.status_code"] == 0
    (headers,) = broker.headers
    assert headers["authorization"] == "Bearer s3cret-token-value"
    # The server saw this span's context: the trace id is the span's.
    assert f"{span.context.trace_id:032x}" in headers["traceparent"]


def test_replicated_proxy_leaves_a_hung_master_for_the_one_the_gateway_names(
    replicas: _Cluster,
) -> None:
    # n1 hangs (paused) after the group elected n2: the receipt would be waited for until
    # the timeout (60 s); a late receipt makes the proxy ask the gateway, which names n2
    # first, and the batch goes there with the same id and sequence.
    async def main() -> tuple[squall.Receipt, squall.Endpoint | None]:
        async with squall.aio.connect(replicas.gateway, timeout_s=60.0, **FAST) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p", replicated=True) as publisher:
                replicas.broker.hung_addresses.add(replicas.addresses["n1"])
                replicas.broker.endpoints = [
                    ("n2", replicas.addresses["n2"]),
                    ("n1", replicas.addresses["n1"]),
                    ("n3", replicas.addresses["n3"]),
                ]
                receipt = await asyncio.wait_for(publisher.publish(b"x"), 30)
                return receipt, publisher.endpoint

    receipt, endpoint = asyncio.run(main())
    assert not receipt.duplicate
    assert endpoint == squall.Endpoint("n2", replicas.addresses["n2"])
    assert replicas.broker.publish_peers == [replicas.addresses["n1"], replicas.addresses["n2"]]
    assert [(p, s) for p, s, _ in _stored_tokens(replicas.broker)] == [("p", 1)]


def test_replicated_proxy_moves_publish_async_batches_off_a_hung_master(
    replicas: _Cluster,
) -> None:
    # Nobody awaits publish() here, only the futures of publish_async: the stream's
    # watchdog, not a waiting caller, must notice the late receipt (before, such batches
    # waited the whole receipt timeout, 60 s here).
    async def main() -> tuple[list[squall.Receipt], squall.Endpoint | None]:
        async with squall.aio.connect(replicas.gateway, timeout_s=60.0, **FAST) as client:
            await client.create_topic("t")
            topic = await client.topic("t")
            async with topic.publisher("p", replicated=True) as publisher:
                replicas.broker.hung_addresses.add(replicas.addresses["n1"])
                replicas.broker.endpoints = [
                    ("n2", replicas.addresses["n2"]),
                    ("n1", replicas.addresses["n1"]),
                    ("n3", replicas.addresses["n3"]),
                ]
                futures = [await publisher.publish_async(b"e%d" % i) for i in range(5)]
                receipts = await asyncio.wait_for(asyncio.gather(*futures), 30)
                return list(receipts), publisher.endpoint

    receipts, endpoint = asyncio.run(main())
    assert len(receipts) == 5 and not any(r.duplicate for r in receipts)
    assert endpoint == squall.Endpoint("n2", replicas.addresses["n2"])
    assert replicas.broker.publish_peers == [replicas.addresses["n1"], replicas.addresses["n2"]]
    assert sorted((p, s) for p, s, _ in _stored_tokens(replicas.broker)) == [
        ("p", s) for s in range(1, 6)
    ]


# -- subscriptions across broken streams (the threaded client's fake replicas) ------------


async def _fill_topic(client: squall.aio.Client, count: int) -> squall.aio.Topic:
    await client.create_topic("t")
    topic = await client.topic("t")
    async with topic.publisher("filler") as publisher:
        await publisher.publish_many(b"%d" % i for i in range(count))
    return topic


def test_durable_subscription_resumes_from_its_cursor_and_dedupe_decides_duplicates(
    replicas: _Cluster,
) -> None:
    async def main() -> tuple[list[int], list[int], int]:
        async with _proxy_client(replicas) as client:
            topic = await _fill_topic(client, 6)
            # Broken after 2 responses of 2: the durable cursor is still 0, so the new
            # stream starts over; dedupe drops what the app already has.
            replicas.broker.break_subscribes, replicas.broker.break_after_responses = 1, 2
            async with topic.subscribe("a", follow=False, max_batch_events=2) as deduped:
                kept = [m.offset async for m in deduped]
            replicas.broker.break_subscribes, replicas.broker.break_after_responses = 1, 2
            async with topic.subscribe("b", follow=False, max_batch_events=2, dedupe=False) as raw:
                every = [m.offset async for m in raw]
            return kept, every, deduped.duplicates_dropped

    kept, every, dropped = asyncio.run(main())
    assert kept == [0, 1, 2, 3, 4, 5]
    assert dropped == 4
    assert every == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]


def test_subscription_gives_up_after_the_budget_and_not_on_a_definite_error(
    replicas: _Cluster,
) -> None:
    async def main() -> None:
        async with squall.aio.connect(
            replicas.gateway, timeout_s=5.0, retry_attempts_max=3, **FAST
        ) as client:
            topic = await _fill_topic(client, 4)
            replicas.broker.break_subscribes, replicas.broker.break_after_responses = 100, 0
            subscription = topic.subscribe(follow=False)
            with pytest.raises(squall.Unavailable):
                [m async for m in subscription]
            assert subscription.reconnects == 2
            replicas.broker.break_subscribes = 1
            replicas.broker.break_code = grpc.StatusCode.PERMISSION_DENIED
            refused = topic.subscribe(follow=False)
            with pytest.raises(squall.PermissionDenied):
                [m async for m in refused]
            assert refused.reconnects == 0

    asyncio.run(main())


def test_close_during_the_reconnect_backoff_ends_iteration(replicas: _Cluster) -> None:
    async def main() -> list[squall.Message]:
        async with squall.aio.connect(
            replicas.gateway,
            timeout_s=5.0,
            retry_backoff_initial_ms=30_000,
            retry_backoff_max_ms=60_000,
        ) as client:
            topic = await _fill_topic(client, 1)
            # The stream breaks at its first response: the subscription waits its
            # (long) backoff before reconnecting.
            replicas.broker.break_subscribes, replicas.broker.break_after_responses = 100, 0
            subscription = topic.subscribe(follow=True)

            async def drain() -> list[squall.Message]:
                return [m async for m in subscription]

            draining = asyncio.create_task(drain())
            await asyncio.sleep(0.5)  # the first stream broke; the backoff is long
            assert replicas.broker.subscribe_requests, "the subscription never subscribed"
            await subscription.close()
            # Ends now, not after the backoff (the draw is up to 30 s; a short one only
            # means another broken stream and another backoff).
            return await asyncio.wait_for(draining, 5)

    assert asyncio.run(main()) == []
