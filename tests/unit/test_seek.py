"""Seek: a durable subscription's cursor moved to a time, an offset, earliest or latest.

Goal: a seek lands on the first event at or after its time (clamped, and saying so, before
the oldest event held; refused in the future), moves the cursor backwards as well as
forwards, is one log entry every replica applies the same way (snapshots included), and
an ack from before a seek can never undo it.
"""

from __future__ import annotations

from contextlib import closing

import pytest

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import seek
from squall_server.replica.commands import (
    BatchBuilder,
    CreateTopic,
    DeleteSubscription,
    Planned,
    Publish,
    SeekCursor,
    SetCursor,
)
from squall_server.replica.store import Store, TimeLookup, TopicInfo

LIMITS = LimitsConfig(topic_subscriptions_max=3)
EARLIEST = broker_pb2.START_POSITION_EARLIEST
LATEST = broker_pb2.START_POSITION_LATEST
OFFSET = broker_pb2.START_POSITION_OFFSET
TIME = broker_pb2.START_POSITION_TIMESTAMP
# Publish times of the fixture's events: offsets 0-1 at 1 000 ms, 2-3 at 2 000, 4-5 at 3 000.
NOW_MS = 10_000


def _commit(store: Store, *commands: object, now_ms: int = NOW_MS) -> list[Planned | ServiceError]:
    builder = BatchBuilder(
        store,
        limits=LIMITS,
        node_id="n1",
        epoch=1,
        next_lsn=store.meta().last_lsn + 1,
        now_ms=now_ms,
    )
    plans: list[Planned | ServiceError] = []
    for command in commands:
        try:
            plans.append(builder.add(command))  # type: ignore[arg-type]
        except ServiceError as exc:
            plans.append(exc)
    store.append(builder.entries, sync=False)
    return plans


def _planned(result: Planned | ServiceError) -> Planned:
    assert isinstance(result, Planned), result
    return result


def _refused(result: Planned | ServiceError, code: Code) -> ServiceError:
    assert isinstance(result, ServiceError) and result.code == code, result
    return result


def _publish(topic: str, count: int) -> Publish:
    return Publish(
        broker_pb2.PublishRequest(
            topic=topic, events=[common_pb2.EventData(payload=b"e") for _ in range(count)]
        )
    )


@pytest.fixture
def store() -> Store:
    store = Store.open_memory()
    store.set_epoch(1)
    _commit(store, CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
    for at_ms in (1_000, 2_000, 3_000):
        _commit(store, _publish("t", 2), now_ms=at_ms)
    _commit(store, SetCursor("t", "s", 0, create=True))
    return store


# --- the pure rules


def _topic(first: int = 0, next_offset: int = 6) -> TopicInfo:
    return TopicInfo(
        name="t",
        topic_id=1,
        kind=common_pb2.TOPIC_KIND_REPLICATED,
        next_offset=next_offset,
        first_offset=first,
        created_ms=0,
    )


def _resolve(position: int, *, offset: int = 0, at_ms: int = 0, first: int = 0) -> seek.SeekTarget:
    return seek.resolve(
        _topic(first=first),
        position,  # type: ignore[arg-type]
        offset=offset,
        timestamp_ms=at_ms,
        now_ms=NOW_MS,
        lookup=lambda ms: TimeLookup(4 if ms > 2_000 else 2, first, 1_000),
    )


def test_a_time_before_the_oldest_event_is_clamped_to_it_and_says_so() -> None:
    target = _resolve(TIME, at_ms=500)
    assert target.cursor == 0
    assert target.clamped == broker_pb2.SEEK_CLAMP_BEFORE_FIRST
    assert "before the oldest event held (offset 0" in target.note


def test_a_time_in_the_future_is_refused_naming_the_masters_clock() -> None:
    with pytest.raises(ServiceError) as caught:
        _resolve(TIME, at_ms=NOW_MS + seek.SEEK_FUTURE_TOLERANCE_MS + 1)
    assert caught.value.code == Code.OUT_OF_RANGE
    assert "in the future" in caught.value.message and "seek to latest" in caught.value.message
    # Within the tolerance (a client clock slightly ahead) it means "now": no refusal.
    assert _resolve(TIME, at_ms=NOW_MS + seek.SEEK_FUTURE_TOLERANCE_MS).cursor == 4


def test_offsets_are_checked_and_clamped_as_subscribe_does() -> None:
    assert _resolve(OFFSET, offset=6).cursor == 6
    assert _resolve(EARLIEST, first=2).cursor == 2 and _resolve(LATEST).cursor == 6
    clamped = _resolve(OFFSET, offset=1, first=2)
    assert (clamped.cursor, clamped.clamped) == (2, broker_pb2.SEEK_CLAMP_BEFORE_FIRST)
    with pytest.raises(ServiceError) as beyond:
        _resolve(OFFSET, offset=7)
    assert beyond.value.code == Code.INVALID_ARGUMENT and "beyond the end" in beyond.value.message
    for bad in ({"position": broker_pb2.START_POSITION_UNSPECIFIED}, {"position": 99}):
        with pytest.raises(ServiceError) as caught:
            _resolve(bad["position"])
        assert caught.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(ServiceError) as negative:
        _resolve(TIME, at_ms=-1)
    assert negative.value.code == Code.INVALID_ARGUMENT


# --- the store's time lookup


def test_time_lookup_finds_the_first_event_at_or_after_the_time(store: Store) -> None:
    found = {ms: store.offset_at_time("t", ms).offset for ms in (0, 1_000, 1_001, 2_000, 3_000)}
    assert found == {0: 0, 1_000: 0, 1_001: 2, 2_000: 2, 3_000: 4}
    assert store.offset_at_time("t", 3_001).offset == 6  # after the newest: the end
    assert store.offset_at_time("t", 0).first_timestamp_ms == 1_000


# --- seeks planned, applied and fenced


def test_seek_by_time_moves_the_cursor_back_and_forth(store: Store) -> None:
    _commit(store, SetCursor("t", "s", 6, create=False))
    back = _planned(_commit(store, SeekCursor("t", "s", TIME, timestamp_ms=2_000))[0]).seek
    assert back is not None and (back.cursor, back.previous_cursor, back.created) == (2, 6, False)
    assert store.get_cursor_state("t", "s") == (2, back.seek_generation)
    assert back.seek_generation == store.meta().last_lsn  # the seek's own entry
    ahead = _planned(_commit(store, SeekCursor("t", "s", TIME, timestamp_ms=2_500))[0]).seek
    assert ahead is not None and ahead.cursor == 4


def test_seek_before_the_first_event_clamps_and_into_the_future_changes_nothing(
    store: Store,
) -> None:
    early, late = _commit(
        store,
        SeekCursor("t", "s", TIME, timestamp_ms=10),
        SeekCursor("t", "s", TIME, timestamp_ms=NOW_MS + 60_000),
    )
    outcome = _planned(early).seek
    assert outcome is not None and outcome.clamped == broker_pb2.SEEK_CLAMP_BEFORE_FIRST
    assert outcome.cursor == 0
    last_lsn = store.meta().last_lsn
    _refused(late, Code.OUT_OF_RANGE)
    _refused(_commit(store, SeekCursor("t", "s", OFFSET, offset=99))[0], Code.INVALID_ARGUMENT)
    assert store.meta().last_lsn == last_lsn  # no entry for a refusal
    assert store.get_cursor_state("t", "s") == (0, outcome.seek_generation)


def test_an_ack_from_before_a_seek_is_refused_and_changes_nothing(store: Store) -> None:
    _commit(store, SetCursor("t", "s", 6, create=False))
    moved = _planned(_commit(store, SeekCursor("t", "s", OFFSET, offset=1))[0]).seek
    assert moved is not None
    stale = _refused(
        _commit(store, SetCursor("t", "s", 6, create=False, seek_generation=0))[0], Code.ABORTED
    )
    assert "moved by a seek" in stale.message and "cursor is 1" in stale.message
    assert store.get_cursor("t", "s") == 1
    # An ack of the stream that started after the seek moves it, and keeps the generation.
    _commit(store, SetCursor("t", "s", 3, create=False, seek_generation=moved.seek_generation))
    assert store.get_cursor_state("t", "s") == (3, moved.seek_generation)
    # A client that sends no generation (written before Seek) is not fenced.
    _commit(store, SetCursor("t", "s", 4, create=False))
    assert store.get_cursor("t", "s") == 4


def test_an_ack_in_the_same_batch_after_a_seek_is_fenced_too(store: Store) -> None:
    _, stale = _commit(
        store,
        SeekCursor("t", "s", EARLIEST),
        SetCursor("t", "s", 5, create=False, seek_generation=0),
    )
    _refused(stale, Code.ABORTED)
    assert store.get_cursor("t", "s") == 0


def test_seek_creates_a_missing_subscription_within_the_limits(store: Store) -> None:
    created = _planned(_commit(store, SeekCursor("t", "new", LATEST))[0]).seek
    assert created is not None and created.created and created.cursor == 6
    assert [name for name, _ in store.list_subscriptions("t")] == ["new", "s"]
    _commit(store, SeekCursor("t", "third", EARLIEST))
    _refused(_commit(store, SeekCursor("t", "fourth", EARLIEST))[0], Code.RESOURCE_EXHAUSTED)
    _refused(_commit(store, SeekCursor("t", "bad name!", EARLIEST))[0], Code.INVALID_ARGUMENT)
    _refused(_commit(store, SeekCursor("nope", "s", EARLIEST))[0], Code.NOT_FOUND)
    _commit(store, CreateTopic("live", common_pb2.TOPIC_KIND_TRANSIENT))
    _refused(_commit(store, SeekCursor("live", "s", EARLIEST))[0], Code.INVALID_ARGUMENT)


def test_a_deleted_and_recreated_subscription_starts_with_no_generation(store: Store) -> None:
    _, _, recreated = _commit(
        store,
        SeekCursor("t", "s", OFFSET, offset=3),
        DeleteSubscription("t", "s"),
        SetCursor("t", "s", 0, create=True),
    )
    _planned(recreated)
    assert store.get_cursor_state("t", "s") == (0, 0)
    # An ack naming generation 0 (the new stream's) is accepted.
    _commit(store, SetCursor("t", "s", 2, create=False, seek_generation=0))
    assert store.get_cursor("t", "s") == 2


def test_a_seek_replicates_and_snapshots_as_the_same_state(store: Store) -> None:
    _commit(store, SetCursor("t", "s", 6, create=False), SeekCursor("t", "s", OFFSET, offset=2))
    slave = Store.open_memory()
    slave.append(store.read_log(1, 1_000), sync=False)
    assert slave.get_cursor_state("t", "s") == store.get_cursor_state("t", "s")
    assert slave.list_subscription_states("t") == store.list_subscription_states("t")
    with closing(store.snapshot_chunks()) as chunks:
        exported = list(chunks)
    fresh = Store.open_memory()
    fresh.begin_snapshot(exported[0].snapshot_lsn, exported[0].snapshot_epoch)
    for chunk in exported:
        fresh.install_chunk(chunk)
    fresh.finish_snapshot(exported[-1].history)
    assert fresh.get_cursor_state("t", "s") == store.get_cursor_state("t", "s")
    # Readers of the cursor alone (written before seek generations) read its first 8 bytes.
    assert fresh.get_cursor("t", "s") == 2
    assert fresh.list_subscriptions("t") == [("s", 2)]
