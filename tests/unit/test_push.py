"""Push subscribers' pure rules and replicated state.

Goals: QoS is parsed with IceStorm's meaning and every bad key or value is refused by
name; retry counting removes a subscriber exactly when its retryCount says (0: the first
failure; n: the (n+1)-th failure in a row; -1: never; NOT_FOUND / UNIMPLEMENTED at once);
the durable cursor never passes an undelivered batch; subscriptions, cursors and
removals are log entries every replica applies alike (and a snapshot carries), and a
late cursor or removal cannot touch a subscriber that subscribed again.
"""

from __future__ import annotations

import pytest

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.commands import (
    BatchBuilder,
    Command,
    CreateTopic,
    DestroyTopic,
    Planned,
    Publish,
    PushCursor,
    PushSubscribe,
    PushUnsubscribe,
)
from squall_server.replica.push_policy import (
    DeliveryState,
    Offered,
    Qos,
    after_failure,
    backoff_ms,
    check_endpoint,
    parse_qos,
)
from squall_server.replica.store import Store

# --- QoS


@pytest.mark.parametrize(
    ("qos", "expected"),
    [
        ({}, Qos(ordered=False, retry_count=0)),  # IceStorm's defaults
        ({"reliability": "ordered"}, Qos(ordered=True, retry_count=0)),
        ({"reliability": ""}, Qos(ordered=False, retry_count=0)),
        ({"retryCount": "-1"}, Qos(retry_count=-1)),
        ({"retryCount": " 7 "}, Qos(retry_count=7)),
        ({"retry_count": "3", "reliability": "ordered"}, Qos(ordered=True, retry_count=3)),
    ],
)
def test_qos_is_parsed_with_icestorm_meaning(qos: dict[str, str], expected: Qos) -> None:
    assert parse_qos(qos) == expected


@pytest.mark.parametrize(
    ("qos", "message"),
    [
        ({"priority": "high"}, "unknown QoS key 'priority'"),
        ({"Reliability": "ordered"}, "unknown QoS key 'Reliability'"),
        ({"reliability": "fifo"}, "reliability 'fifo' is not one of 'ordered' and ''"),
        ({"retryCount": "three"}, "retryCount 'three' is not an integer"),
        ({"retryCount": "1.5"}, "not an integer"),
        ({"retry_count": "-2"}, "retry_count -2 is outside -1..1000000"),
        ({"retryCount": "1000001"}, "outside -1..1000000"),
        ({"retryCount": "1", "retry_count": "1"}, "one key spelt two ways"),
    ],
)
def test_bad_qos_is_refused_by_name(qos: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_qos(qos)


def test_canonical_qos_map_round_trips() -> None:
    qos = Qos(ordered=True, retry_count=-1)
    assert qos.to_map() == {"reliability": "ordered", "retryCount": "-1"}
    assert parse_qos(qos.to_map()) == qos


@pytest.mark.parametrize("endpoint", ["127.0.0.1:7300", "subscriber.local:80", "[::1]:9"])
def test_good_endpoints(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("", "must be host:port"),
        ("localhost", "must be host:port"),
        ("127.0.0.1:0", "outside 1..65535"),
        ("127.0.0.1:http", "is not a number"),
        ("0.0.0.0:7300", "wildcard"),
        ("::1:7300", "in brackets"),
        ("bad_host!:1", "not a valid host name"),
        ("a" * 300 + ":1", "longer than 255"),
    ],
)
def test_malformed_endpoints_are_refused(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match="malformed endpoint") as caught:
        check_endpoint(endpoint)
    assert message in str(caught.value)


# --- retry counting


@pytest.mark.parametrize(
    ("code", "failures", "retry_count", "decision"),
    [
        ("UNAVAILABLE", 1, 0, "remove"),  # 0: remove on the first failure
        ("UNAVAILABLE", 1, 1, "remove"),  # 1: the same
        ("UNAVAILABLE", 1, 2, "retry"),
        ("DEADLINE_EXCEEDED", 2, 3, "retry"),  # n: kept through n - 1 failures...
        ("INTERNAL", 3, 3, "remove"),  # ...and removed on the n-th in a row
        ("UNAVAILABLE", 10_000, -1, "retry"),  # -1: forever
        ("NOT_FOUND", 1, -1, "remove"),  # hard failures: at once, whatever the count
        ("UNIMPLEMENTED", 1, 5, "remove"),
    ],
)
def test_after_failure(code: str, failures: int, retry_count: int, decision: str) -> None:
    assert after_failure(code, failures, retry_count) == decision


def test_after_failure_needs_the_failure_counted() -> None:
    with pytest.raises(ValueError):
        after_failure("UNAVAILABLE", 0, 1)


def test_backoff_doubles_to_its_cap_with_jitter_on_the_upper_half() -> None:
    assert [backoff_ms(n, 100, 1000, 0.0) for n in range(1, 7)] == [50, 100, 200, 400, 500, 500]
    assert backoff_ms(1, 100, 1000, 0.999) == 99
    assert backoff_ms(200, 100, 1000, 0.5) == 750  # no overflow for long outages
    with pytest.raises(ValueError):
        backoff_ms(1, 100, 1000, 1.0)


def _ok(first: int, end: int) -> Offered:
    return Offered(first, end, "OK")


def _failed(first: int, end: int, code: str = "UNAVAILABLE") -> Offered:
    return Offered(first, end, code, "connection refused")


def test_ordered_offers_one_batch_and_repeats_a_failed_one_until_removed() -> None:
    state = DeliveryState(10, Qos(ordered=True, retry_count=2), inflight_batches_max=8)
    assert (state.retry_batches(), state.new_batches()) == ([], 1)
    result = state.finish_round([_ok(10, 15)])
    assert (result.action, result.cursor, state.position) == ("continue", 15, 15)
    result = state.finish_round([_failed(15, 20)])
    assert (result.action, result.cursor, result.failures) == ("backoff", 15, 1)
    # The failed batch comes first, alone: nothing overtakes it.
    assert (state.retry_batches(), state.new_batches()) == ([(15, 20)], 0)
    result = state.finish_round([_failed(15, 20)])
    assert result.action == "remove"
    assert "2 failed deliveries in a row with retryCount 2" in result.reason
    assert "UNAVAILABLE: connection refused" in result.reason
    assert result.cursor == 15


def test_a_success_resets_the_count() -> None:
    state = DeliveryState(0, Qos(ordered=True, retry_count=2), inflight_batches_max=1)
    assert state.finish_round([_failed(0, 5)]).action == "backoff"
    assert state.finish_round([_ok(0, 5)]).failures == 0
    assert state.last_error == ""
    assert state.finish_round([_failed(5, 9)]).action == "backoff"  # one failure again
    assert state.finish_round([_failed(5, 9)]).action == "remove"


def test_unordered_keeps_the_cursor_below_a_failed_batch_and_counts_rounds() -> None:
    state = DeliveryState(0, Qos(ordered=False, retry_count=2), inflight_batches_max=3)
    assert state.new_batches() == 3
    result = state.finish_round([_ok(0, 4), _failed(4, 8), _ok(8, 12)])
    # One failed batch in a round of three is one failure; the cursor waits below it.
    assert (result.action, result.cursor, result.failures) == ("backoff", 4, 1)
    assert state.position == 12
    assert (state.retry_batches(), state.new_batches()) == ([(4, 8)], 2)
    result = state.finish_round([_ok(4, 8), _ok(12, 14)])
    assert (result.action, result.cursor, result.failures) == ("continue", 14, 0)


def test_unordered_removal_needs_consecutive_failed_rounds_not_many_failed_calls() -> None:
    state = DeliveryState(0, Qos(ordered=False, retry_count=2), inflight_batches_max=4)
    result = state.finish_round([_failed(0, 2), _failed(2, 4), _failed(4, 6)])
    assert (result.action, result.failures) == ("backoff", 1)
    result = state.finish_round([_failed(0, 2), _ok(2, 4), _ok(4, 6)])
    assert (result.action, result.cursor) == ("remove", 0)


def test_a_hard_failure_removes_at_once_and_says_so() -> None:
    state = DeliveryState(0, Qos(ordered=False, retry_count=-1), inflight_batches_max=2)
    result = state.finish_round([_failed(0, 3), _failed(3, 6, "NOT_FOUND")])
    assert result.action == "remove"
    assert "answered NOT_FOUND (no such subscriber there)" in result.reason


def test_retry_forever_never_removes() -> None:
    state = DeliveryState(0, Qos(retry_count=-1), inflight_batches_max=1)
    for failures in range(1, 101):  # bounded: a hundred outages in a row
        assert state.finish_round([_failed(0, 1)]).action == "backoff"
        assert state.failures == failures


# --- replicated state: the batch builder and the store

LIMITS = LimitsConfig(push_subscribers_max=3)


def _plan(store: Store, *commands: Command) -> list[Planned | ServiceError]:
    """Plans commands in one batch and appends its entries, as the master's writer does."""
    meta = store.meta()
    builder = BatchBuilder(
        store, limits=LIMITS, node_id="n1", epoch=1, next_lsn=meta.last_lsn + 1, now_ms=5
    )
    out: list[Planned | ServiceError] = []
    for command in commands:
        try:
            out.append(builder.add(command))
        except ServiceError as exc:
            out.append(exc)
    store.append(builder.entries, sync=False)
    return out


def _subscribe(
    subscriber_id: str,
    *,
    topic: str = "t",
    start: broker_pb2.StartPosition.ValueType = broker_pb2.START_POSITION_LATEST,
    offset: int = 0,
) -> PushSubscribe:
    return PushSubscribe(topic, subscriber_id, "127.0.0.1:7300", True, 3, start, offset)


def _code(result: Planned | ServiceError) -> Code | None:
    return result.code if isinstance(result, ServiceError) else None


@pytest.fixture
def store() -> Store:
    store = Store.open_memory()
    store.set_epoch(1)
    _plan(store, CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
    request = broker_pb2.PublishRequest(topic="t", events=[common_pb2.EventData(payload=b"x")] * 5)
    _plan(store, Publish(request))
    return store


def test_subscribe_starts_where_asked_and_is_stored(store: Store) -> None:
    latest, earliest, offset = _plan(
        store,
        _subscribe("latest"),
        _subscribe("earliest", start=broker_pb2.START_POSITION_EARLIEST),
        _subscribe("offset", start=broker_pb2.START_POSITION_OFFSET, offset=3),
    )
    assert [p.cursor for p in (latest, earliest, offset) if isinstance(p, Planned)] == [5, 0, 3]
    stored = store.list_push_subscribers("t")
    assert [(s.subscriber_id, s.cursor) for s in stored] == [
        ("earliest", 0),
        ("latest", 5),
        ("offset", 3),
    ]
    assert stored[1].endpoint == "127.0.0.1:7300" and stored[1].ordered
    assert stored[1].retry_count == 3 and stored[1].created_ms == 5
    assert store.get_push_subscriber("t", "latest") == stored[1]
    assert store.list_push_subscribers() == stored


def test_already_subscribed_also_within_one_batch(store: Store) -> None:
    first, again = _plan(store, _subscribe("s"), _subscribe("s"))
    assert isinstance(first, Planned) and _code(again) == Code.ALREADY_EXISTS
    assert "AlreadySubscribed" in str(again)
    [later] = _plan(store, _subscribe("s"))
    assert _code(later) == Code.ALREADY_EXISTS
    assert len(store.list_push_subscribers("t")) == 1


def test_refusals_store_nothing(store: Store) -> None:
    before = store.meta().last_lsn
    results = _plan(
        store,
        _subscribe("s", topic="nope"),
        _subscribe("s", start=broker_pb2.START_POSITION_OFFSET, offset=6),
        _subscribe("s", start=99),  # type: ignore[arg-type]
        PushUnsubscribe("t", "absent", "unsubscribed"),
        PushCursor("t", "absent", 3, 0),
    )
    assert [_code(r) for r in results] == [
        Code.NOT_FOUND,
        Code.INVALID_ARGUMENT,
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.NOT_FOUND,
    ]
    assert store.meta().last_lsn == before
    assert store.list_push_subscribers("t") == []


def test_the_subscriber_limit_counts_the_batch(store: Store) -> None:
    _plan(store, _subscribe("a"))
    results = _plan(store, _subscribe("b"), _subscribe("c"), _subscribe("d"))
    assert [_code(r) for r in results] == [None, None, Code.RESOURCE_EXHAUSTED]
    assert "push_subscribers_max is 3" in str(results[2])


def test_cursor_moves_forward_only_and_within_the_topic(store: Store) -> None:
    _plan(store, _subscribe("s", start=broker_pb2.START_POSITION_EARLIEST))
    lsn = store.get_push_subscriber("t", "s").lsn  # type: ignore[union-attr]
    before = store.meta().last_lsn
    forward, backward, beyond = _plan(
        store,
        PushCursor("t", "s", 4, lsn),
        PushCursor("t", "s", 2, lsn),
        PushCursor("t", "s", 9, lsn),
    )
    assert isinstance(forward, Planned) and forward.entry_index is not None
    assert isinstance(backward, Planned) and backward.entry_index is None  # no entry
    assert _code(beyond) == Code.INVALID_ARGUMENT
    assert store.meta().last_lsn == before + 1
    assert store.get_push_subscriber("t", "s").cursor == 4  # type: ignore[union-attr]


def test_a_late_cursor_or_removal_cannot_touch_a_new_incarnation(store: Store) -> None:
    _plan(store, _subscribe("s", start=broker_pb2.START_POSITION_EARLIEST))
    old = store.get_push_subscriber("t", "s")
    assert old is not None
    _plan(
        store,
        PushUnsubscribe("t", "s", "unsubscribed"),
        _subscribe("s", start=broker_pb2.START_POSITION_EARLIEST),
    )
    new = store.get_push_subscriber("t", "s")
    assert new is not None and new.lsn != old.lsn
    stale_cursor, stale_removal = _plan(
        store, PushCursor("t", "s", 5, old.lsn), PushUnsubscribe("t", "s", "failed", old.lsn)
    )
    assert _code(stale_cursor) == _code(stale_removal) == Code.NOT_FOUND
    assert "subscribed again" in str(stale_cursor)
    assert store.get_push_subscriber("t", "s") == new


def test_destroying_a_topic_drops_its_push_subscribers(store: Store) -> None:
    _plan(store, _subscribe("s"))
    _plan(
        store,
        DestroyTopic("t"),
        CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED),
        _subscribe("s"),  # not AlreadySubscribed: the topic is a new one
    )
    [again] = store.list_push_subscribers("t")
    assert again.cursor == 0


def test_every_replica_applies_the_log_alike_and_a_snapshot_carries_it(store: Store) -> None:
    _plan(store, _subscribe("a"), _subscribe("b", start=broker_pb2.START_POSITION_EARLIEST))
    lsn = store.get_push_subscriber("t", "b").lsn  # type: ignore[union-attr]
    _plan(store, PushCursor("t", "b", 3, lsn), PushUnsubscribe("t", "a", "removed", 0))
    replica = Store.open_memory()
    replica.append(store.read_log(1, 1000), sync=False)
    assert replica.list_push_subscribers() == store.list_push_subscribers()
    installed = Store.open_memory()
    chunks = list(store.snapshot_chunks())
    installed.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        installed.install_chunk(chunk)
    installed.finish_snapshot([(b.epoch, b.start_lsn) for b in chunks[-1].history])
    [b] = installed.list_push_subscribers()
    assert (b.subscriber_id, b.cursor) == ("b", 3)


def test_the_failure_count_is_replicated_for_the_next_master(store: Store) -> None:
    """A failed round writes the count even when the cursor stays (issue 20): a replica
    applying the log, or a snapshot, holds it, so a new master's worker continues it;
    a round that succeeds writes 0."""
    _plan(store, _subscribe("s", start=broker_pb2.START_POSITION_EARLIEST))
    lsn = store.get_push_subscriber("t", "s").lsn  # type: ignore[union-attr]
    before = store.meta().last_lsn
    failed, same, behind = _plan(
        store,
        PushCursor("t", "s", 0, lsn, failures=2),
        PushCursor("t", "s", 0, lsn, failures=2),  # nothing new: no entry
        PushCursor("t", "s", 0, lsn, failures=3),  # a count, never a cursor moved back
    )
    assert isinstance(failed, Planned) and failed.entry_index is not None
    assert isinstance(same, Planned) and same.entry_index is None
    assert isinstance(behind, Planned) and behind.entry_index is not None
    assert store.meta().last_lsn == before + 2
    held = store.get_push_subscriber("t", "s")
    assert held is not None and (held.cursor, held.failures) == (0, 3)
    replica = Store.open_memory()
    replica.append(store.read_log(1, 1000), sync=False)
    assert replica.get_push_subscriber("t", "s") == held
    installed = Store.open_memory()
    chunks = list(store.snapshot_chunks())
    installed.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        installed.install_chunk(chunk)
    installed.finish_snapshot([(b.epoch, b.start_lsn) for b in chunks[-1].history])
    assert installed.get_push_subscriber("t", "s") == held
    # The worker a new master starts counts on from there: one more failure removes a
    # subscriber with retryCount 4 (it took 3 under the old master).
    state = DeliveryState(held.cursor, Qos(ordered=True, retry_count=4), 1)
    state.failures = held.failures
    assert state.finish_round([_failed(0, 5)]).action == "remove"
    _plan(store, PushCursor("t", "s", 5, lsn, failures=0))
    held = store.get_push_subscriber("t", "s")
    assert held is not None and (held.cursor, held.failures) == (5, 0)
