"""Shared subscriptions' replicated state: the planner's refusals and the store's records.

Goal: bad settings (max_deliveries < 1, a dead-letter topic that does not exist or is the
subscription's own topic, a name already used by a plain subscription) are refused with a
status naming the problem and write nothing; acks and failures are log entries every
replica applies the same way (snapshots included); the cursor moves over the acked
prefix only; a new master built from the store redelivers exactly what was not acked, and
refuses a late ack of an offset another consumer acknowledged; a seek forgets it all.
"""

from __future__ import annotations

from contextlib import closing

import pytest

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.common.errors import Code, ServiceError
from squall_server.replica.commands import (
    BatchBuilder,
    CreateShared,
    CreateTopic,
    DestroyTopic,
    Planned,
    Publish,
    SeekCursor,
    SetCursor,
    SharedAck,
    SharedFail,
)
from squall_server.replica.shared import SharedConfig, SharedSubscription
from squall_server.replica.store import SharedState, Store


def _commit(store: Store, *commands: object) -> list[Planned | ServiceError]:
    builder = BatchBuilder(
        store,
        limits=LimitsConfig(),
        node_id="n1",
        epoch=1,
        next_lsn=store.meta().last_lsn + 1,
        now_ms=1_000,
    )
    plans: list[Planned | ServiceError] = []
    for command in commands:
        try:
            plans.append(builder.add(command))  # type: ignore[arg-type]
        except ServiceError as exc:
            plans.append(exc)
    store.append(builder.entries, sync=False)
    return plans


def _refused(result: Planned | ServiceError, code: Code, text: str) -> None:
    assert isinstance(result, ServiceError) and result.code == code, result
    assert text in result.message, result.message


def _create(dead_letter_topic: str = "dlq", max_deliveries: int = 3) -> CreateShared:
    return CreateShared("t", "w", 1_000, max_deliveries, dead_letter_topic)


@pytest.fixture
def store() -> Store:
    store = Store.open_memory()
    store.set_epoch(1)
    _commit(store, CreateTopic("t", common_pb2.TOPIC_KIND_REPLICATED))
    _commit(store, CreateTopic("dlq", common_pb2.TOPIC_KIND_REPLICATED))
    request = broker_pb2.PublishRequest(
        topic="t", events=[common_pb2.EventData(payload=b"e") for _ in range(6)]
    )
    _commit(store, Publish(request))
    return store


def _state(store: Store) -> SharedState:
    state = store.get_shared("t", "w")
    assert state is not None
    return state


def test_bad_settings_are_refused_and_write_nothing(store: Store) -> None:
    last = store.meta().last_lsn
    results = _commit(
        store,
        _create(max_deliveries=0),
        _create(dead_letter_topic="nope"),
        _create(dead_letter_topic="t"),
        SetCursor("t", "plain", 0, create=True),
    )
    _refused(results[0], Code.INVALID_ARGUMENT, "max_deliveries must be >= 1")
    _refused(results[1], Code.NOT_FOUND, "dead-letter topic 'nope' does not exist")
    _refused(results[2], Code.INVALID_ARGUMENT, "is the subscription's own topic")
    assert store.meta().last_lsn == last + 1  # only the plain subscription
    assert store.get_shared("t", "w") is None
    taken = _commit(store, CreateShared("t", "plain", 1_000, 3, "dlq"))[0]
    _refused(taken, Code.ALREADY_EXISTS, "a plain durable subscription")
    _refused(_commit(store, SharedAck("t", "plain", (0,), "a"))[0], Code.NOT_FOUND, "shared")


def test_acks_and_failures_replicate_and_the_cursor_moves_over_the_acked_prefix(
    store: Store,
) -> None:
    created = _commit(store, _create())[0]
    assert isinstance(created, Planned) and created.created
    again = _commit(store, _create())[0]
    assert isinstance(again, Planned) and not again.created
    _refused(_commit(store, _create(max_deliveries=4))[0], Code.ALREADY_EXISTS, "other settings")
    _commit(store, SharedAck("t", "w", (1, 3), "a"), SharedFail("t", "w", 0, "boom", False))
    state = _state(store)
    assert state.cursor == 0 and state.done == {1, 3} and state.failures == {0: 1}
    assert state.errors == {0: "boom"} and state.acked_by == {1: "a", 3: "a"}
    _commit(store, SharedFail("t", "w", 0, "boom again", True))  # dead-lettered
    state = _state(store)
    assert state.cursor == 2 and state.done == {3} and state.settings.dead_lettered == 1
    assert state.acked_by == {0: "", 1: "a", 3: "a"}  # kept below the cursor: who acked
    assert store.get_cursor("t", "w") == 2

    slave = Store.open_memory()
    slave.append(store.read_log(1, 1_000), sync=False)
    assert slave.get_shared("t", "w") == store.get_shared("t", "w")
    with closing(store.snapshot_chunks()) as chunks:
        exported = list(chunks)
    fresh = Store.open_memory()
    fresh.begin_snapshot(exported[0].snapshot_lsn, exported[0].snapshot_epoch)
    for chunk in exported:
        fresh.install_chunk(chunk)
    fresh.finish_snapshot(exported[-1].history)
    assert fresh.get_shared("t", "w") == store.get_shared("t", "w")


def test_a_new_master_redelivers_what_was_not_acked_and_refuses_another_consumers_ack(
    store: Store,
) -> None:
    _commit(store, _create())
    _commit(store, SharedAck("t", "w", (0, 2), "a"), SharedFail("t", "w", 4, "boom", False))
    state = _state(store)
    core = SharedSubscription(
        SharedConfig(ack_deadline_ms=1_000, max_deliveries=3),
        epoch=2,
        floor=state.cursor,
        committed_end=6,
        acked=state.done,
        failures=state.failures,
        last_errors=state.errors,
        acked_by=state.acked_by,
    )
    pulled = core.pull("b", 10, now_ms=0)
    assert sorted(d.offset for d in pulled) == [1, 3, 4, 5]
    assert {d.offset: d.attempt for d in pulled}[4] == 2
    # "a" acked offset 0 in the earlier epoch; "c" (its lease lapsed there) may not.
    with pytest.raises(ServiceError) as caught:
        core.ack("c", [0], 1)
    assert caught.value.code == Code.FAILED_PRECONDITION and "'a' acknowledged" in str(caught.value)
    assert core.ack("a", [0], 1).acked == []  # a retried ack of its own: ok, nothing new


def test_a_seek_forgets_the_state_and_a_destroy_deletes_it(store: Store) -> None:
    _commit(store, _create())
    _commit(store, SharedAck("t", "w", (0, 1, 4), "a"), SharedFail("t", "w", 3, "x", False))
    _commit(store, SeekCursor("t", "w", broker_pb2.START_POSITION_OFFSET, offset=1))
    state = _state(store)
    assert state.cursor == 1 and not state.done and not state.failures and not state.acked_by
    _commit(store, DestroyTopic("t"))
    assert store.get_shared("t", "w") is None
    assert store.counts()["shared"] == 0


def test_exclusive_settings_are_stored_and_compared(store: Store) -> None:
    exclusive = CreateShared("t", "x", 2_000, 3, "", exclusive=True)
    created = _commit(store, exclusive)[0]
    assert isinstance(created, Planned) and created.created
    settings = store.get_shared_settings("t", "x")
    assert settings is not None and settings.exclusive
    assert settings.exclusive_takeover_ms == 2_000  # 0: the ack deadline
    again = _commit(store, exclusive)[0]
    assert isinstance(again, Planned) and not again.created
    shared_mode = CreateShared("t", "x", 2_000, 3, "")
    _refused(_commit(store, shared_mode)[0], Code.ALREADY_EXISTS, "other settings")
