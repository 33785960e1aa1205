"""The client library retries indeterminate publishes, and only those, exactly once in effect.

Goal: against a fake broker that stores a batch and then loses the answer (the stream ends
with UNAVAILABLE, UNKNOWN or DEADLINE_EXCEEDED), `publish`, `publish_many` and
`publish_async` resend the same (publisher_id, sequence) pairs on a fresh stream, so every
publish the app sees succeed is stored exactly once; a definite refusal is raised at once
and never resent; when the retries run out the app gets `Indeterminate` (maybe_stored).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc
from tests.unit.test_client import FakeBroker, serve_fake, wait_until

FAST = {"retry_backoff_initial_ms": 1, "retry_backoff_max_ms": 5}


class FlakyBroker(FakeBroker):
    """The fake broker, able to lose answers after storing and to refuse before storing."""

    def __init__(self) -> None:
        super().__init__()
        # Requests that are stored and then answered by ending the stream with lose_code.
        self.lose_answers = 0
        self.lose_code = grpc.StatusCode.UNAVAILABLE
        # Requests refused with refuse_code before anything is stored.
        self.refusals = 0
        self.refuse_code = grpc.StatusCode.FAILED_PRECONDITION
        # From this stream on (counting from 1), every request is refused (0: never).
        self.refuse_from_stream = 0

    def PublishStream(
        self,
        request_iterator: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        with self.cond:
            self.publish_stream_calls += 1
            refusing = 0 < self.refuse_from_stream <= self.publish_stream_calls
        for request in request_iterator:
            with self.cond:
                self.requests_seen += 1
                refuse = refusing or self.refusals > 0
                self.refusals -= self.refusals > 0
            if refuse:
                context.abort(self.refuse_code, "refused before storing")
            response = self._apply(request, context)
            with self.cond:
                lose = self.lose_answers > 0
                self.lose_answers -= lose
            if lose:
                context.abort(self.lose_code, "stored, but the answer was lost")
            yield response


@pytest.fixture
def flaky() -> Iterator[FlakyBroker]:
    fake = FlakyBroker()
    server, address = serve_fake(fake)
    fake.address = address  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        server.stop(grace=None)


def _connect(broker: FlakyBroker, **retry: int) -> squall.Client:
    address: str = broker.address  # type: ignore[attr-defined]
    return squall.connect(address, timeout_s=5.0, **{**FAST, **retry})


def _stored(broker: FlakyBroker, topic: str = "t") -> collections.Counter[tuple[str, int]]:
    """How many times each (publisher_id, sequence) is stored in the topic."""
    with broker.cond:
        events = list(broker.topics[topic].events)
    return collections.Counter((e.publisher_id, e.sequence) for e in events)


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED],
)
def test_lost_answer_is_retried_and_stored_once(flaky: FlakyBroker, code: grpc.StatusCode) -> None:
    flaky.lose_answers, flaky.lose_code = 2, code
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            receipt = publisher.publish(b"once")
            assert publisher.resends == 2
    # The first attempt stored it; the retries were recognised as duplicates.
    assert (receipt.offset, receipt.duplicate) == (0, True)
    assert _stored(flaky) == {("p", 1): 1}
    assert flaky.publish_stream_calls == 3


def test_publish_many_retries_each_lost_batch_and_stores_every_event_once(
    flaky: FlakyBroker,
) -> None:
    flaky.lose_answers = 3
    payloads = [b"e%d" % i for i in range(50)]
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            receipts = publisher.publish_many(payloads, batch_events=5)
    assert len(receipts) == 50
    assert _stored(flaky) == {("p", sequence): 1 for sequence in range(1, 51)}
    # Every receipt points at the stored copy of its own event.
    events = flaky.topics["t"].events
    assert [events[r.offset].payload for r in receipts] == payloads


def test_publish_async_retries_lost_batches_and_every_future_succeeds(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 2
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p", inflight_batches_max=2) as publisher:
            futures = [publisher.publish_async(b"a%d" % i) for i in range(200)]
            publisher.flush()
            receipts = [f.result(0) for f in futures]
    assert len({r.offset for r in receipts}) == 200
    assert _stored(flaky) == {("p", sequence): 1 for sequence in range(1, 201)}


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, squall.FailedPrecondition),
        (grpc.StatusCode.INVALID_ARGUMENT, squall.InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, squall.ResourceExhausted),
        (grpc.StatusCode.ABORTED, squall.Aborted),
    ],
)
def test_definite_failure_is_raised_at_once_and_not_retried(
    flaky: FlakyBroker, code: grpc.StatusCode, kind: type[squall.SquallError]
) -> None:
    flaky.refusals, flaky.refuse_code = 1, code
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            with pytest.raises(kind) as err:
                publisher.publish(b"refused")
            assert type(err.value) is kind
            assert not err.value.maybe_stored
            assert publisher.resends == 0
            # The next publish goes through on a new stream.
            assert publisher.publish(b"after").offset == 0
    assert flaky.requests_seen == 2
    assert _stored(flaky) == {("p", 2): 1}


def test_missing_topic_is_definite_and_not_retried(flaky: FlakyBroker) -> None:
    with _connect(flaky) as client:
        client.create_topic("t")
        topic = client.topic("t")
        client.destroy_topic("t")
        with topic.publisher("p") as publisher, pytest.raises(squall.NotFound):
            publisher.publish(b"x")
        assert publisher.resends == 0
    assert flaky.publish_stream_calls == 1


def test_exhausted_retries_raise_indeterminate_and_store_at_most_once(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 1_000
    with _connect(flaky, retry_attempts_max=3) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            with pytest.raises(squall.Indeterminate) as err:
                publisher.publish(b"lost")
            assert publisher.resends == 2
    assert err.value.maybe_stored
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert flaky.publish_stream_calls == 3
    assert _stored(flaky) == {("p", 1): 1}


def test_retrying_stops_at_the_total_time_bound(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 1_000
    retry = {"retry_attempts_max": 100, "retry_total_ms_max": 200, "retry_backoff_max_ms": 20}
    with _connect(flaky, **retry) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            started = time.monotonic()
            with pytest.raises(squall.Indeterminate):
                publisher.publish(b"lost")
            elapsed_s = time.monotonic() - started
    # No retry starts after 0.2 s; one more attempt and a loopback round trip fit in 2 s.
    assert elapsed_s < 2.0
    assert flaky.publish_stream_calls < 100
    assert _stored(flaky) == {("p", 1): 1}


def test_definite_answer_after_a_lost_one_is_still_indeterminate(flaky: FlakyBroker) -> None:
    # The first attempt stores the event and loses the answer; the retry is refused
    # definitely. The event is stored, so the app must not hear "definitely failed".
    flaky.lose_answers = 1
    flaky.refuse_from_stream = 2
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            with pytest.raises(squall.Indeterminate) as err:
                publisher.publish(b"stored")
            assert publisher.resends == 1
    assert err.value.maybe_stored
    assert isinstance(err.value.__cause__, squall.FailedPrecondition)
    assert "an earlier attempt may have stored the events" in err.value.details
    assert _stored(flaky) == {("p", 1): 1}


def test_single_attempt_client_does_not_retry(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 1
    with _connect(flaky, retry_attempts_max=1) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p") as publisher:
            with pytest.raises(squall.Indeterminate):
                publisher.publish(b"x")
            assert publisher.resends == 0
    assert flaky.publish_stream_calls == 1


def test_async_events_buffered_when_the_stream_broke_are_sent_on_the_next(
    flaky: FlakyBroker,
) -> None:
    # A one-batch window: while the first batch waits, later events queue in the buffer;
    # the stream ends, and the buffer goes out on a fresh stream instead of failing.
    flaky.lose_answers = 1
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p", inflight_batches_max=1) as publisher:
            futures = [publisher.publish_async(b"b%d" % i) for i in range(50)]
            wait_until(lambda: all(f.done() for f in futures))
            assert all(f.exception() is None for f in futures)
    assert _stored(flaky) == {("p", sequence): 1 for sequence in range(1, 51)}


def test_threads_sharing_a_publisher_survive_lost_answers_each_event_stored_once(
    flaky: FlakyBroker,
) -> None:
    # 40 threads publish one event at a time each on one publisher (a two-request window,
    # so most events travel joined); two answers are lost after storing: every caller
    # still gets its receipt, at its own event, and nothing is stored twice.
    flaky.lose_answers = 2
    receipts: dict[int, squall.Receipt] = {}
    failures: list[BaseException] = []
    with _connect(flaky) as client:
        client.create_topic("t")
        with client.topic("t").publisher("p", inflight_batches_max=2) as publisher:

            def publish(index: int) -> None:
                try:
                    for round_ in range(3):
                        receipts[index * 3 + round_] = publisher.publish(
                            b"t%d" % (index * 3 + round_)
                        )
                except BaseException as exc:  # reported below
                    failures.append(exc)

            threads = [threading.Thread(target=publish, args=(i,)) for i in range(40)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
    assert not failures
    assert _stored(flaky) == {("p", sequence): 1 for sequence in range(1, 121)}
    events = flaky.topics["t"].events
    assert all(events[r.offset].payload == b"t%d" % i for i, r in receipts.items())
    assert len(receipts) == 120 and flaky.requests_seen < 120
    assert flaky.lose_answers == 0  # both answers were lost, and their batches retried


@pytest.mark.parametrize(
    ("retry", "message"),
    [
        ({"retry_attempts_max": -1}, "retry_attempts_max must be from 0 to 100000, got -1"),
        ({"retry_backoff_initial_ms": 0}, "retry_backoff_initial_ms must be from 1 to 60000"),
        (
            {"retry_backoff_initial_ms": 500, "retry_backoff_max_ms": 100},
            "retry_backoff_initial_ms must not exceed retry_backoff_max_ms (100), got 500",
        ),
        ({"retry_total_ms_max": -1}, "retry_total_ms_max must be from 1 to 3600000, got -1"),
    ],
)
def test_connect_rejects_bad_retry_bounds(retry: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as err:
        squall.connect("127.0.0.1:1", **retry)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_connect_defaults_match_the_policy_defaults() -> None:
    with squall.connect("127.0.0.1:1") as client:
        assert client.retry == squall.RetryPolicy()
        assert client.retry.attempts_max == squall.RETRY_ATTEMPTS_MAX_DEFAULT


class _FakeClock:
    """The retry budget's clock: it moves only when the publisher sleeps between retries."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now_s += seconds


def _fake_clock_publisher(
    broker: FlakyBroker, clock: _FakeClock, policy: squall.RetryPolicy
) -> tuple[grpc.Channel, squall.Publisher]:
    address: str = broker.address  # type: ignore[attr-defined]
    channel = grpc.insecure_channel(address)
    publisher = squall.Publisher(
        broker_pb2_grpc.PublisherStub(channel),
        "t",
        "p",
        retry=policy,
        monotonic=clock.monotonic,
        sleep=clock.sleep,
    )
    return channel, publisher


def test_the_default_retry_budget_is_time_not_a_count_of_attempts(flaky: FlakyBroker) -> None:
    # Issue 14: 16 attempts with backoff capped at 250 ms used to give up after about 2 s
    # although the budget said 10 s. Every answer is lost here: the publisher keeps
    # retrying until 10 s of (fake) time have passed, far beyond 16 attempts.
    flaky.lose_answers = 100_000
    clock = _FakeClock()
    with _connect(flaky) as client:
        client.create_topic("t")
    channel, publisher = _fake_clock_publisher(flaky, clock, squall.RetryPolicy())
    with channel, pytest.raises(squall.Indeterminate) as err:
        publisher.publish(b"lost")
    assert err.value.maybe_stored
    assert clock.now_s >= squall.RETRY_TOTAL_MS_MAX_DEFAULT / 1000
    # The last wait started before the budget ran out, and a wait is at most 250 ms.
    assert clock.now_s < squall.RETRY_TOTAL_MS_MAX_DEFAULT / 1000 + 0.25
    assert publisher.resends > 16
    assert _stored(flaky) == {("p", 1): 1}


def test_a_publish_outlasting_many_attempts_succeeds_within_the_time_budget(
    flaky: FlakyBroker,
) -> None:
    # 40 lost answers in a row (an outage of several seconds at 250 ms backoff): the
    # publish still succeeds, stored once, because 60 s of budget are left.
    flaky.lose_answers = 40
    clock = _FakeClock()
    with _connect(flaky) as client:
        client.create_topic("t")
    policy = squall.RetryPolicy(total_ms_max=60_000)
    channel, publisher = _fake_clock_publisher(flaky, clock, policy)
    with channel:
        receipt = publisher.publish(b"late")
    assert publisher.resends == 40
    assert (receipt.offset, receipt.duplicate) == (0, True)
    assert _stored(flaky) == {("p", 1): 1}


def test_an_attempt_cap_still_bounds_retrying_when_set(flaky: FlakyBroker) -> None:
    flaky.lose_answers = 100_000
    clock = _FakeClock()
    with _connect(flaky) as client:
        client.create_topic("t")
    policy = squall.RetryPolicy(attempts_max=5, total_ms_max=3_600_000)
    channel, publisher = _fake_clock_publisher(flaky, clock, policy)
    with channel, pytest.raises(squall.Indeterminate):
        publisher.publish(b"lost")
    assert publisher.resends == 4
