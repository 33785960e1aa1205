"""Push subscribers, IceStorm style, with real processes (issue 5: 6, 8).

A three-node cluster (deploy/cluster.example.toml) and its gateway; the subscribers are
`squall.PushEndpoint`s in this test process. Goals:

* a push subscriber receives every committed event, ordered or not, and its durable
  cursor reaches the topic's end (GetSubscribers);
* a subscriber whose deliveries fail is removed as its retryCount says (0: on the first
  failure; n: after n failed deliveries in a row), at once on a hard failure (NOT_FOUND
  from its endpoint),
  and kept when it recovers within its retries; GetSubscribers shows it gone;
* a repeat subscribe is AlreadySubscribed; bad input (unknown topic, malformed endpoint,
  unknown QoS key or value, an endpoint that cannot be reached or does not hold the id)
  gets a status naming the problem and registers nothing;
* kill -9 of the master while it delivers: the new master resumes from the durable
  cursor and the subscriber has seen every committed event (duplicates allowed), each
  ordered delivery in offset order with no gap.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import squall
from deploy import processes
from squall.v1 import broker_pb2, broker_pb2_grpc
from squall_server import cli
from tests.integration.conftest import ROOT, LocalCluster, make_cluster, wait_for
from tests.integration.test_gateway import _AppPublisher, _kill_master_while_publishing

pytestmark = pytest.mark.integration

EVENTS = 200


class Recorder:
    """A push subscriber's callback that remembers every delivery (thread-safe)."""

    def __init__(self, fail_first: int = 0, fail_always: bool = False) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[squall.PushDelivery] = []
        self.calls = 0
        self.attempts: list[int] = []  # PushDelivery.attempt of every call
        self._fail_first = fail_first
        self._fail_always = fail_always

    def __call__(self, delivery: squall.PushDelivery) -> None:
        with self.lock:
            self.calls += 1
            self.attempts.append(delivery.attempt)
            failing = self._fail_always or self.calls <= self._fail_first
            if not failing:
                self.deliveries.append(delivery)
        if failing:
            raise RuntimeError(f"subscriber down (call {self.calls})")

    def offsets(self) -> set[int]:
        with self.lock:
            return {m.offset for d in self.deliveries for m in d.messages}

    def batches(self) -> list[squall.PushDelivery]:
        with self.lock:
            return list(self.deliveries)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One running three-node cluster for the tests that kill nothing."""
    run_dir: Path = tmp_path_factory.mktemp("push-trio")
    cluster = make_cluster(ROOT / "deploy" / "cluster.example.toml", run_dir)
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture
def client(trio: LocalCluster) -> Iterator[squall.Client]:
    with squall.connect(trio.gateway_address, timeout_s=10.0) as connected:
        yield connected


@pytest.fixture
def endpoint() -> Iterator[squall.PushEndpoint]:
    with squall.PushEndpoint() as serving:
        yield serving


def _publish(client: squall.Client, topic: str, count: int, start: int = 0) -> list[int]:
    """Publishes count events through the gateway; returns their offsets."""
    with client.topic(topic).publisher() as publisher:
        receipts = publisher.publish_many(b"event %d" % i for i in range(start, start + count))
    return [r.offset for r in receipts]


def _subscriber_ids(client: squall.Client, topic: str) -> list[str]:
    return [s.subscriber_id for s in client.topic(topic).push_subscribers()]


def test_push_subscribers_receive_every_committed_event(
    client: squall.Client, endpoint: squall.PushEndpoint
) -> None:
    client.create_topic("push-all")
    topic = client.topic("push-all")
    ordered, unordered = Recorder(), Recorder()
    info = topic.subscribe_push(
        "ordered-1", endpoint, reliability="ordered", retry_count=-1, on_delivery=ordered
    )
    assert info.ordered and info.retry_count == -1 and info.cursor == 0
    assert dict(info.qos) == {"reliability": "ordered", "retryCount": "-1"}
    topic.subscribe_push("unordered-1", endpoint, retry_count=3, on_delivery=unordered)
    offsets = _publish(client, "push-all", EVENTS)
    assert offsets == list(range(EVENTS))
    for recorder in (ordered, unordered):
        wait_for(lambda r=recorder: r.offsets() >= set(offsets), 20, "every event delivered")
    # Ordered: each delivery follows the last one, in offset order, with no gap.
    expected = 0
    for delivery in ordered.batches():
        got = [m.offset for m in delivery.messages]
        assert got == list(range(expected, expected + len(got))), (expected, got)
        assert [m.payload for m in delivery.messages] == [b"event %d" % o for o in got]
        expected += len(got)
    assert expected == EVENTS
    # The durable cursors reach the end (written through the log, batched).
    wait_for(
        lambda: [s.cursor for s in topic.push_subscribers()] == [EVENTS, EVENTS],
        10,
        "both cursors at the topic's end",
    )
    listed = topic.push_subscribers()
    assert [s.subscriber_id for s in listed] == ["ordered-1", "unordered-1"]
    assert listed[1].qos["reliability"] == "" and listed[1].retry_count == 3
    assert all(s.endpoint == endpoint.address for s in listed)
    # Unsubscribe: no more deliveries, and it is gone from the list.
    topic.unsubscribe_push("ordered-1")
    assert _subscriber_ids(client, "push-all") == ["unordered-1"]
    _publish(client, "push-all", 10, start=EVENTS)
    wait_for(lambda: len(unordered.offsets()) == EVENTS + 10, 10, "the rest delivered")
    assert max(ordered.offsets()) < EVENTS
    with pytest.raises(squall.NotFound, match="ordered-1"):
        topic.unsubscribe_push("ordered-1")


def test_a_repeat_subscribe_is_already_subscribed(
    client: squall.Client, endpoint: squall.PushEndpoint
) -> None:
    client.create_topic("push-again")
    topic = client.topic("push-again")
    recorder = Recorder()
    topic.subscribe_push("s1", endpoint, on_delivery=recorder)
    with pytest.raises(squall.AlreadySubscribed, match=r"AlreadySubscribed.*s1"):
        topic.subscribe_push("s1", endpoint, reliability="ordered", on_delivery=Recorder())
    # The first subscription is untouched, and still delivered to the first callback.
    [listed] = topic.push_subscribers()
    assert listed.subscriber_id == "s1" and not listed.ordered
    _publish(client, "push-again", 5)
    wait_for(lambda: recorder.offsets() == set(range(5)), 10, "the first subscription delivers")


def test_bad_subscribes_name_the_problem_and_register_nothing(
    client: squall.Client, endpoint: squall.PushEndpoint
) -> None:
    client.create_topic("push-bad")
    topic = client.topic("push-bad")
    endpoint.add("good-id", Recorder())
    stub = broker_pb2_grpc.PushSubscriptionsStub(client.channel)

    def subscribe(**fields: object) -> grpc.RpcError:
        request = broker_pb2.SubscribeAndGetPublisherRequest(
            topic="push-bad", subscriber_id="good-id", endpoint=endpoint.address
        )
        for name, value in fields.items():
            if name == "qos":
                request.qos.update(value)  # type: ignore[arg-type]
            else:
                setattr(request, name, value)
        with pytest.raises(grpc.RpcError) as caught:
            stub.SubscribeAndGetPublisher(request, timeout=10)
        return caught.value

    free_port = processes.free_port()
    cases: list[tuple[dict[str, object], grpc.StatusCode, str]] = [
        ({"topic": "no-such-topic"}, grpc.StatusCode.NOT_FOUND, "topic 'no-such-topic'"),
        ({"endpoint": "localhost"}, grpc.StatusCode.INVALID_ARGUMENT, "malformed endpoint"),
        ({"endpoint": "127.0.0.1:99999"}, grpc.StatusCode.INVALID_ARGUMENT, "outside 1..65535"),
        ({"endpoint": ""}, grpc.StatusCode.INVALID_ARGUMENT, "malformed endpoint ''"),
        ({"qos": {"priority": "high"}}, grpc.StatusCode.INVALID_ARGUMENT, "unknown QoS key"),
        (
            {"qos": {"reliability": "fifo"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            "reliability 'fifo'",
        ),
        ({"qos": {"retryCount": "lots"}}, grpc.StatusCode.INVALID_ARGUMENT, "not an integer"),
        ({"qos": {"retry_count": "-2"}}, grpc.StatusCode.INVALID_ARGUMENT, "outside -1"),
        ({"subscriber_id": "bad id"}, grpc.StatusCode.INVALID_ARGUMENT, "push subscriber id"),
        ({"start": 42}, grpc.StatusCode.INVALID_ARGUMENT, "start position 42"),
        (
            {"start": broker_pb2.START_POSITION_OFFSET, "offset": 5},
            grpc.StatusCode.INVALID_ARGUMENT,
            "beyond the end",
        ),
        (
            {"endpoint": f"127.0.0.1:{free_port}"},
            grpc.StatusCode.FAILED_PRECONDITION,
            "cannot be reached",
        ),
        (
            {"subscriber_id": "not-hosted"},
            grpc.StatusCode.FAILED_PRECONDITION,
            "NOT_FOUND",
        ),
    ]
    for fields, code, text in cases:
        error = subscribe(**fields)
        assert error.code() == code, (fields, error.code(), error.details())
        assert text in (error.details() or ""), (fields, error.details())
    # Nothing was half-registered by any of them.
    assert topic.push_subscribers() == []
    # The library refuses its own bad input before sending, and maps the rest.
    with pytest.raises(ValueError, match="start must be"):
        topic.subscribe_push("good-id", endpoint, start="middle")  # type: ignore[arg-type]
    with pytest.raises(squall.FailedPrecondition, match="nothing was registered"):
        topic.subscribe_push("absent", f"127.0.0.1:{free_port}")
    with pytest.raises(squall.NotFound):
        client.topic("push-bad").unsubscribe_push("absent")
    stub_get = broker_pb2_grpc.PushSubscriptionsStub(client.channel).GetSubscribers
    with pytest.raises(grpc.RpcError) as caught:
        stub_get(broker_pb2.GetSubscribersRequest(topic="nope"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert topic.push_subscribers() == []


def test_the_cli_lists_and_unsubscribes_push_subscribers(
    trio: LocalCluster,
    client: squall.Client,
    endpoint: squall.PushEndpoint,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.create_topic("push-cli")
    client.topic("push-cli").subscribe_push(
        "s1", endpoint, reliability="ordered", retry_count=5, on_delivery=Recorder()
    )
    gateway = ["--gateway", trio.gateway_address]
    assert cli.main(["topic", "subscribers", "push-cli", *gateway]) == 0
    assert capsys.readouterr().out == (
        f"s1\t{endpoint.address}\treliability=ordered\tretryCount=5\tcursor=0\tfailures=0\n"
    )
    assert cli.main(["topic", "unsubscribe", "push-cli", "s1", *gateway]) == 0
    assert capsys.readouterr().out == "unsubscribed s1 from topic push-cli\n"
    assert cli.main(["topic", "unsubscribe", "push-cli", "s1", *gateway]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def _gone_everywhere(trio: LocalCluster, topic: str, subscriber_id: str) -> bool:
    """True once no replica lists the subscriber: its removal went through the log."""
    for node in trio.config.nodes:
        with grpc.insecure_channel(node.replica_address) as channel:
            stub = broker_pb2_grpc.PushSubscriptionsStub(channel)
            response = stub.GetSubscribers(broker_pb2.GetSubscribersRequest(topic=topic), timeout=5)
        if any(s.subscriber_id == subscriber_id for s in response.subscribers):
            return False
    return True


@pytest.mark.parametrize("retry_count", [0, 3])
def test_a_failing_subscriber_is_removed_per_retry_count(
    trio: LocalCluster, client: squall.Client, endpoint: squall.PushEndpoint, retry_count: int
) -> None:
    name = f"push-fail-{retry_count}"
    client.create_topic(name)
    topic = client.topic(name)
    failing, healthy = Recorder(fail_always=True), Recorder()
    topic.subscribe_push(
        "failing", endpoint, reliability="ordered", retry_count=retry_count, on_delivery=failing
    )
    topic.subscribe_push("healthy", endpoint, retry_count=retry_count, on_delivery=healthy)
    _publish(client, name, 1)  # one event: one batch per delivery attempt
    wait_for(lambda: _subscriber_ids(client, name) == ["healthy"], 20, "'failing' removed")
    wait_for(lambda: _gone_everywhere(trio, name, "failing"), 10, "removed on every replica")
    # max(retry_count, 1) failed deliveries of the same batch in a row, then removal.
    tries = max(retry_count, 1)
    assert failing.attempts == list(range(tries))
    assert healthy.offsets() == {0}
    # Removed means no more deliveries.
    _publish(client, name, 1)
    wait_for(lambda: healthy.offsets() == {0, 1}, 10, "the healthy subscriber goes on")
    assert failing.calls == tries


def test_a_subscriber_that_recovers_within_its_retries_is_kept(
    client: squall.Client, endpoint: squall.PushEndpoint
) -> None:
    client.create_topic("push-recover")
    topic = client.topic("push-recover")
    flaky = Recorder(fail_first=2)
    topic.subscribe_push("flaky", endpoint, reliability="ordered", retry_count=3, on_delivery=flaky)
    _publish(client, "push-recover", 1)
    wait_for(lambda: flaky.offsets() == {0}, 10, "delivered on the last try it had")
    assert flaky.attempts == [0, 1, 2]
    [listed] = topic.push_subscribers()
    assert listed.subscriber_id == "flaky" and listed.consecutive_failures == 0
    # The count restarts after a success: two more failures in a row are still retried.
    flaky._fail_first = flaky.calls + 2
    _publish(client, "push-recover", 1)
    wait_for(lambda: flaky.offsets() == {0, 1}, 10, "delivered again after two failures")
    assert _subscriber_ids(client, "push-recover") == ["flaky"]


def test_no_such_subscriber_removes_at_once_even_when_retrying_forever(
    client: squall.Client, endpoint: squall.PushEndpoint
) -> None:
    client.create_topic("push-hard")
    topic = client.topic("push-hard")
    forever = Recorder(fail_first=3)
    topic.subscribe_push("forever", endpoint, retry_count=-1, on_delivery=forever)
    topic.subscribe_push("leaving", endpoint, retry_count=-1, on_delivery=Recorder())
    _publish(client, "push-hard", 1)
    wait_for(lambda: forever.offsets() == {0}, 10, "delivered after three failures")
    # The endpoint stops hosting 'leaving': its next delivery gets NOT_FOUND, a hard failure.
    assert endpoint.remove("leaving")
    _publish(client, "push-hard", 1)
    wait_for(lambda: _subscriber_ids(client, "push-hard") == ["forever"], 10, "'leaving' removed")
    wait_for(lambda: forever.offsets() == {0, 1}, 10, "'forever' goes on")


def _committed_offsets(address: str, topic: str) -> set[int]:
    """Every committed offset of a topic, read from one replica."""
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=topic, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=20,
        )
        return {event.offset for response in stream for event in response.events}


def test_delivery_resumes_from_the_new_master_after_kill_9(cluster_factory: object) -> None:
    trio = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(trio, LocalCluster)
    trio.start_all()
    ordered, unordered = Recorder(), Recorder()
    with (
        squall.PushEndpoint() as endpoint,
        squall.connect(trio.gateway_address, timeout_s=10.0) as client,
    ):
        client.create_topic("push-failover")
        topic = client.topic("push-failover")
        topic.subscribe_push(
            "ordered", endpoint, reliability="ordered", retry_count=-1, on_delivery=ordered
        )
        topic.subscribe_push("unordered", endpoint, retry_count=-1, on_delivery=unordered)
        publisher = topic.publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        old, new = _kill_master_while_publishing(trio, app)
        publisher.close()
        assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}
        acked = {receipt.offset for receipt in app.acked.values()}
        committed = _committed_offsets(trio.replica_address(new), "push-failover")
        assert acked <= committed
        for recorder in (ordered, unordered):
            wait_for(
                lambda r=recorder: r.offsets() >= committed,
                30,
                "every committed event delivered after the failover",
            )
        # The subscriptions moved with the log: the new master lists them and its
        # cursors reach the end of the topic.
        end = max(committed) + 1
        wait_for(
            lambda: [s.cursor for s in topic.push_subscribers()] == [end, end],
            10,
            "both durable cursors at the topic's end on the new master",
        )
    batches = ordered.batches()
    masters = [d.master_id for d in batches]
    assert masters[0] == old and masters[-1] == new, (masters[0], masters[-1])
    assert set(masters) == {old, new}
    # Ordered: each delivery is in offset order without gaps, and follows the previous
    # one, except that the new master starts again at the durable cursor (at or below
    # where the old one got: those events come again, duplicates, never a gap).
    position = 0
    resumed = 0
    for previous, delivery in zip([None, *batches], batches, strict=False):
        got = [m.offset for m in delivery.messages]
        assert got == list(range(got[0], got[0] + len(got))), got
        if previous is not None and previous.master_id != delivery.master_id:
            assert got[0] <= position, (got[0], position)
            resumed += 1
        else:
            assert got[0] == position, (got[0], position)
        position = got[-1] + 1
    assert resumed == 1
    assert position == end
