"""The master's batch planning: offsets, deduplication and refusals within one group commit.

Goal: a retried (publisher_id, sequence) is answered with its original offset whether
the original is in the store or earlier in the same batch, and a refused command leaves
no trace in the batch it was part of.
"""

from __future__ import annotations

import pytest

import squall
from squall._types import receipt_count, receipts_from_pb
from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.commands import (
    BatchBuilder,
    CreateTopic,
    DestroyTopic,
    Publish,
    SetCursor,
    check_publish_limits,
    expand_receipt,
)
from squall_server.replica.store import DedupeHit, Store

LIMITS = LimitsConfig(dedupe_window=10, max_batch_events=10)


def _builder(store: Store, epoch: int = 1) -> BatchBuilder:
    return BatchBuilder(
        store,
        limits=LIMITS,
        node_id="n1",
        epoch=epoch,
        next_lsn=store.meta().last_lsn + 1,
        now_ms=1_000,
    )


def _publish(topic: str, *sequences: int, publisher_id: str = "p") -> Publish:
    return Publish(
        broker_pb2.PublishRequest(
            topic=topic,
            publisher_id=publisher_id,
            events=[common_pb2.EventData(payload=f"s{s}".encode(), sequence=s) for s in sequences],
        )
    )


def _commit(store: Store, *commands: object) -> list[object]:
    builder = _builder(store)
    plans: list[object] = []
    for command in commands:
        try:
            plans.append(builder.add(command))  # type: ignore[arg-type]
        except ServiceError as exc:
            plans.append(exc)
    store.append(builder.entries, sync=False)
    return plans


@pytest.fixture
def store() -> Store:
    store = Store.open_memory(dedupe_window=LIMITS.dedupe_window)
    store.set_epoch(1)
    _commit(store, CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
    return store


def test_topic_created_earlier_in_the_batch_can_be_published_to() -> None:
    store = Store.open_memory()
    store.set_epoch(1)
    _, publish = _commit(
        store, CreateTopic("fresh", common_pb2.TOPIC_KIND_REPLICATED), _publish("fresh", 1, 2)
    )
    assert [r.offset for r in publish.receipts] == [0, 1]  # type: ignore[union-attr]
    assert [e.payload for e in store.read_events("fresh", 0, 10)] == [b"s1", b"s2"]


def test_retry_in_the_same_batch_gets_the_original_offsets(store: Store) -> None:
    _, retry = _commit(store, _publish("t", 1, 2), _publish("t", 2, 3))
    assert [(r.offset, r.duplicate) for r in retry.receipts] == [(1, True), (2, False)]  # type: ignore[union-attr]
    assert [e.payload for e in store.read_events("t", 0, 10)] == [b"s1", b"s2", b"s3"]


def test_retry_after_commit_is_answered_from_the_store(store: Store) -> None:
    _commit(store, _publish("t", 1, 2, 3))
    (retry,) = _commit(store, _publish("t", 2))
    assert [(r.offset, r.duplicate) for r in retry.receipts] == [(1, True)]  # type: ignore[union-attr]
    assert len(store.read_events("t", 0, 10)) == 3


def test_a_compact_receipt_says_what_one_receipt_per_event_says(store: Store) -> None:
    # Duplicates first, between and last, around new events: the client's expansion of the
    # compact form and the replica's per-event form (for raw-stub callers) must agree.
    _commit(store, _publish("t", 1, 2, 3))
    (plan,) = _commit(store, _publish("t", 2, 4, 3, 5, 1))
    receipt = plan.receipt  # type: ignore[union-attr]
    receipt.master_id = "n1"
    receipt.holders.add(node_id="n2", durability=common_pb2.SYNC_POLICY_WRITE_NO_SYNC)
    per_event = expand_receipt(receipt)
    assert [(r.offset, r.duplicate) for r in per_event] == [
        (1, True),
        (3, False),
        (2, True),
        (4, False),
        (0, True),
    ]
    assert {r.lsn for r in per_event if not r.duplicate} == {receipt.lsn}
    compact = receipts_from_pb(broker_pb2.PublishResponse(batch=receipt))
    long = receipts_from_pb(broker_pb2.PublishResponse(receipts=per_event))
    assert compact == long
    assert compact[0].holders == (squall.Holder("n2", "write_no_sync"),)
    assert receipt_count(broker_pb2.PublishResponse(batch=receipt)) == 5


def test_sequence_below_the_window_is_refused_not_duplicated(store: Store) -> None:
    _commit(store, _publish("t", *range(1, 11)), _publish("t", *range(11, 21)))
    (old,) = _commit(store, _publish("t", 5))
    assert isinstance(old, ServiceError) and old.code == Code.FAILED_PRECONDITION
    assert "deduplication window" in old.message
    assert len(store.read_events("t", 0, 100)) == 20


def test_refused_command_leaves_no_trace_in_its_batch(store: Store) -> None:
    oversized = Publish(
        broker_pb2.PublishRequest(
            topic="t", events=[common_pb2.EventData(payload=b"x" * (LIMITS.max_event_bytes + 1))]
        )
    )
    _, refused, after = _commit(store, _publish("t", 1), oversized, _publish("t", 2))
    assert isinstance(refused, ServiceError) and refused.code == Code.INVALID_ARGUMENT
    assert "max_event_bytes" in refused.message
    assert [r.offset for r in after.receipts] == [1]  # type: ignore[union-attr]


def test_headers_count_against_max_event_bytes() -> None:
    limits = LimitsConfig(max_event_bytes=100)
    small = common_pb2.EventData(payload=b"x" * 40, headers={"trace": "y" * 40})
    check_publish_limits(broker_pb2.PublishRequest(topic="t", events=[small]), limits)
    heavy = common_pb2.EventData(payload=b"x" * 40, headers={"trace": "y" * 60})
    with pytest.raises(ServiceError) as refused:
        check_publish_limits(broker_pb2.PublishRequest(topic="t", events=[heavy]), limits)
    assert refused.value.code == Code.INVALID_ARGUMENT
    assert "105 bytes (key + payload + headers)" in refused.value.message


def test_cursor_moves_only_forward_and_never_past_the_end(store: Store) -> None:
    _commit(store, _publish("t", 1, 2, 3), SetCursor("t", "s", 0, create=True))
    forward, backward, beyond = _commit(
        store,
        SetCursor("t", "s", 2, create=False),
        SetCursor("t", "s", 1, create=False),
        SetCursor("t", "s", 9, create=False),
    )
    assert forward.cursor == 2 and backward.cursor == 2  # type: ignore[union-attr]
    assert isinstance(beyond, ServiceError) and beyond.code == Code.INVALID_ARGUMENT
    assert store.get_cursor("t", "s") == 2


def test_same_sequence_on_another_topic_is_refused(store: Store) -> None:
    _commit(store, CreateTopic("u", common_pb2.TOPIC_KIND_REPLICATED), _publish("t", 1))
    (other,) = _commit(store, _publish("u", 1))
    assert isinstance(other, ServiceError) and "already used sequence 1" in other.message


def test_durable_subscriptions_per_topic_are_bounded_across_batches(store: Store) -> None:
    limits = LimitsConfig(dedupe_window=10, max_batch_events=10, topic_subscriptions_max=3)

    def commit(*commands: SetCursor) -> list[object]:
        builder = BatchBuilder(
            store,
            limits=limits,
            node_id="n1",
            epoch=1,
            next_lsn=store.meta().last_lsn + 1,
            now_ms=1_000,
        )
        plans: list[object] = []
        for command in commands:
            try:
                plans.append(builder.add(command))
            except ServiceError as exc:
                plans.append(exc)
        store.append(builder.entries, sync=False)
        return plans

    commit(SetCursor("t", "a", 0, create=True))
    b, c, d = commit(
        SetCursor("t", "b", 0, create=True),
        SetCursor("t", "c", 0, create=True),
        SetCursor("t", "d", 0, create=True),
    )
    assert not isinstance(b, ServiceError) and not isinstance(c, ServiceError)
    assert isinstance(d, ServiceError) and d.code == Code.RESOURCE_EXHAUSTED
    assert "limits.topic_subscriptions_max is 3" in d.message
    assert [name for name, _ in store.list_subscriptions("t")] == ["a", "b", "c"]
    # An existing subscription is still served, and so is another topic.
    (again,) = commit(SetCursor("t", "a", 0, create=True))
    assert not isinstance(again, ServiceError)


def test_topic_count_is_bounded_by_name() -> None:
    store = Store.open_memory(dedupe_window=10)
    store.set_epoch(1)
    limits = LimitsConfig(dedupe_window=10, max_batch_events=10, max_topics=2)
    builder = BatchBuilder(store, limits=limits, node_id="n1", epoch=1, next_lsn=1, now_ms=1)
    builder.add(CreateTopic("a", common_pb2.TOPIC_KIND_REPLICATED))
    builder.add(CreateTopic("b", common_pb2.TOPIC_KIND_REPLICATED))
    with pytest.raises(ServiceError) as refused:
        builder.add(CreateTopic("c", common_pb2.TOPIC_KIND_REPLICATED))
    assert refused.value.code == Code.RESOURCE_EXHAUSTED
    assert refused.value.message == "topic limit reached: limits.max_topics is 2"


def test_name_lengths_are_bounded_by_the_limits_and_a_refusal_stores_nothing() -> None:
    store = Store.open_memory(dedupe_window=10)
    store.set_epoch(1)
    limits = LimitsConfig(
        dedupe_window=10,
        max_batch_events=10,
        max_topic_name_bytes=8,
        max_subscription_name_bytes=5,
        max_publisher_id_bytes=4,
    )
    builder = BatchBuilder(store, limits=limits, node_id="n1", epoch=1, next_lsn=1, now_ms=1)
    builder.add(CreateTopic("orders", common_pb2.TOPIC_KIND_REPLICATED))
    store.append(builder.entries, sync=False)
    builder = BatchBuilder(store, limits=limits, node_id="n1", epoch=1, next_lsn=2, now_ms=1)
    refusals = [
        (
            CreateTopic("orders-eu", common_pb2.TOPIC_KIND_REPLICATED),
            "topic name 'orders-eu' is 9 bytes long: limits.max_topic_name_bytes is 8",
        ),
        (
            SetCursor("orders", "billing", 0, create=True),
            "subscription name 'billing' is 7 bytes long: limits.max_subscription_name_bytes is 5",
        ),
        (
            Publish(
                broker_pb2.PublishRequest(
                    topic="orders",
                    publisher_id="app-1",
                    events=[common_pb2.EventData(payload=b"x", sequence=1)],
                )
            ),
            "publisher id 'app-1' is 5 bytes long: limits.max_publisher_id_bytes is 4",
        ),
    ]
    for command, message in refusals:
        with pytest.raises(ServiceError) as refused:
            builder.add(command)
        assert refused.value.code == Code.INVALID_ARGUMENT
        assert refused.value.message == message
    assert builder.entries == []
    # At the limit is fine.
    builder.add(SetCursor("orders", "bill", 0, create=True))
    builder.add(
        Publish(
            broker_pb2.PublishRequest(
                topic="orders",
                publisher_id="app1",
                events=[common_pb2.EventData(payload=b"x", sequence=1)],
            )
        )
    )
    assert len(builder.entries) == 2


# --- a topic's incarnation


def _stored(store: Store, topic: str) -> list[tuple[int, int, bytes]]:
    return [(e.offset, e.sequence, e.payload) for e in store.read_events(topic, 0, 100)]


def test_a_recreated_topic_takes_the_same_sequences_as_new_events(store: Store) -> None:
    """The issue's reproduction at the master: after destroy + create, the publisher's
    sequences 1..3 are stored again at offsets 0..2, not answered as duplicates."""
    _commit(store, _publish("t", 1, 2, 3, publisher_id="pub-fixed"))
    _commit(store, DestroyTopic("t"))
    _commit(store, CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
    (publish,) = _commit(store, _publish("t", 1, 2, 3, publisher_id="pub-fixed"))
    assert [(r.offset, r.duplicate) for r in publish.receipts] == [  # type: ignore[union-attr]
        (0, False),
        (1, False),
        (2, False),
    ]
    assert _stored(store, "t") == [(0, 1, b"s1"), (1, 2, b"s2"), (2, 3, b"s3")]
    # ... and a retry now is a duplicate of the new incarnation's event.
    (retry,) = _commit(store, _publish("t", 2, publisher_id="pub-fixed"))
    assert [(r.offset, r.duplicate) for r in retry.receipts] == [(1, True)]  # type: ignore[union-attr]


def test_destroy_and_recreate_in_one_batch_forget_the_old_sequences(store: Store) -> None:
    _commit(store, _publish("t", 1, 2, publisher_id="p"))
    plans = _commit(
        store,
        _publish("t", 3, publisher_id="p"),
        DestroyTopic("t"),
        CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED),
        _publish("t", 1, 2, 3, publisher_id="p"),
    )
    assert not any(isinstance(p, ServiceError) for p in plans), plans
    assert [(r.offset, r.duplicate) for r in plans[-1].receipts] == [  # type: ignore[union-attr]
        (0, False),
        (1, False),
        (2, False),
    ]
    assert _stored(store, "t") == [(0, 1, b"s1"), (1, 2, b"s2"), (2, 3, b"s3")]


def test_a_duplicate_receipt_never_points_outside_the_topic(store: Store) -> None:
    """The invariant check: were the store to return a hit the topic does not hold, the
    publish fails with INTERNAL (retryable) instead of answering duplicate=True."""
    _commit(store, _publish("t", 1, 2, 3))
    wrong = DedupeHit(topic="t", offset=7, lsn=3, epoch=1)
    original = store.lookup_sequence
    store.lookup_sequence = lambda publisher_id, sequence: wrong  # type: ignore[method-assign]
    try:
        (refused,) = _commit(store, _publish("t", 2))
    finally:
        store.lookup_sequence = original  # type: ignore[method-assign]
    assert isinstance(refused, ServiceError)
    assert refused.code == Code.INTERNAL
    assert "invariant violated" in refused.message and "offset 7" in refused.message
    assert len(store.read_events("t", 0, 10)) == 3


def test_a_durable_subscription_of_a_destroyed_topic_is_not_found_again(store: Store) -> None:
    _commit(store, _publish("t", 1, 2, 3))
    _commit(store, SetCursor("t", "billing", 3, create=True))
    plans = _commit(
        store,
        DestroyTopic("t"),
        CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED),
        SetCursor("t", "billing", 0, create=True),
    )
    assert plans[-1].cursor == 0  # type: ignore[union-attr]
    assert store.get_cursor("t", "billing") == 0
