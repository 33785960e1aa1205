"""The store's contract, run against both twins (LMDB and in-memory).

Every test here must pass on both, so the simulator's memory store behaves like the
production LMDB store. Engine-specific behaviour (reopen, map full, damaged files) is in
test_store_lmdb.py.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.batch_bytes import framed_event_bytes
from squall_server.replica.store import (
    DEDUPE_WINDOW_DEFAULT,
    DedupeHit,
    EpochBoundary,
    InvalidEntryError,
    LogCompactedError,
    StaleEpochError,
    Store,
    StoreFullError,
    StoreMeta,
    TopicInfo,
    UnknownTopicError,
    make_entry,
)

StoreFactory = Callable[..., Store]
Op = replica_pb2.Operation


@pytest.fixture(params=["memory", "lmdb"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Opens stores of the parametrized twin; closes them at the end."""
    stores: list[Store] = []

    def make(*, dedupe_window: int = DEDUPE_WINDOW_DEFAULT) -> Store:
        if request.param == "memory":
            store = Store.open_memory(dedupe_window=dedupe_window)
        else:
            path = tmp_path / f"store-{len(stores)}"
            store = Store.open_lmdb(path, 64 << 20, dedupe_window=dedupe_window)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def store(make_store: StoreFactory) -> Store:
    """An empty store of the parametrized twin."""
    return make_store()


# --- building entries, as a master would


def epoch_start(epoch: int) -> Op:
    return Op(epoch_start=replica_pb2.EpochStartOp(epoch=epoch, master_id="n1"))


def create(
    name: str,
    kind: common_pb2.TopicKind.ValueType = common_pb2.TOPIC_KIND_REPLICATED,
    created_ms: int = 1000,
) -> Op:
    return Op(create_topic=replica_pb2.CreateTopicOp(name=name, kind=kind, created_ms=created_ms))


def destroy(name: str) -> Op:
    return Op(destroy_topic=replica_pb2.DestroyTopicOp(name=name))


def publish(
    topic: str,
    first_offset: int,
    payloads: list[bytes],
    *,
    publisher_id: str = "",
    sequences: list[int] | None = None,
    timestamp_ms: int = 5000,
    session_token: str = "",
) -> Op:
    events = [
        common_pb2.EventData(payload=p, sequence=(sequences[i] if sequences else 0))
        for i, p in enumerate(payloads)
    ]
    return Op(
        publish=replica_pb2.PublishOp(
            topic=topic,
            first_offset=first_offset,
            publisher_id=publisher_id,
            session_token=session_token,
            timestamp_ms=timestamp_ms,
            events=events,
        )
    )


def set_cursor(topic: str, subscription: str, cursor: int) -> Op:
    return Op(
        set_cursor=replica_pb2.SetCursorOp(topic=topic, subscription=subscription, cursor=cursor)
    )


def delete_subscription(topic: str, subscription: str) -> Op:
    return Op(
        delete_subscription=replica_pb2.DeleteSubscriptionOp(topic=topic, subscription=subscription)
    )


class Writer:
    """Appends consecutive entries to a store, starting after its last LSN."""

    def __init__(self, store: Store, epoch: int = 1) -> None:
        self.store = store
        self.epoch = epoch
        self.lsn = store.meta().last_lsn

    def entries(self, *ops: Op, epoch: int | None = None) -> list[replica_pb2.LogEntry]:
        """Entries for ops at the next LSNs, without appending them."""
        use = self.epoch if epoch is None else epoch
        return [make_entry(self.lsn + 1 + i, use, op) for i, op in enumerate(ops)]

    def append(self, *ops: Op, epoch: int | None = None) -> list[replica_pb2.LogEntry]:
        """Appends ops as one batch."""
        entries = self.entries(*ops, epoch=epoch)
        self.store.append(entries, sync=False)
        self.lsn += len(entries)
        if epoch is not None:
            self.epoch = epoch
        return entries


def observe(store: Store, publishers: tuple[str, ...] = ()) -> tuple[Any, ...]:
    """Everything a reader can see, for 'nothing changed' checks."""
    meta = store.meta()
    topics = store.list_topics()
    events = {t.name: store.read_events(t.name, 0, 100_000) for t in topics}
    subscriptions = {t.name: store.list_subscriptions(t.name) for t in topics}
    log = store.read_log(1, 100_000) if meta.last_lsn else []
    dedupe = {
        p: (store.publisher_high_water(p), [store.lookup_sequence(p, s) for s in range(1, 50)])
        for p in publishers
    }
    return meta, topics, events, subscriptions, log, dedupe


def topic(store: Store, name: str) -> TopicInfo:
    """The topic, which must exist."""
    info = store.get_topic(name)
    assert info is not None, f"no topic {name!r}"
    return info


def payloads(count: int, start: int = 0) -> list[bytes]:
    return [f"event-{i}".encode() for i in range(start, start + count)]


# --- meta


def test_empty_store_meta(store: Store) -> None:
    assert store.meta() == StoreMeta(
        cluster_id="",
        shutdown_id="",
        state=common_pb2.STORE_STATE_EMPTY,
        epoch=0,
        max_seen=0,
        last_lsn=0,
        last_epoch=0,
        history=(),
        log_start_lsn=1,
        snapshot_pending=False,
    )
    assert store.log_start_lsn() == 1
    assert store.list_topics() == []
    assert store.get_topic("t") is None
    assert store.read_log(1, 10) == []
    assert store.publisher_high_water("p") == 0
    assert store.lookup_sequence("p", 1) is None


def test_meta_setters(store: Store) -> None:
    store.set_cluster_id("c1")
    store.set_state(common_pb2.STORE_STATE_CLEAN, shutdown_id="s-42")
    store.set_max_seen(7)
    store.set_max_seen(3)  # max seen only grows
    meta = store.meta()
    assert (meta.cluster_id, meta.state, meta.shutdown_id, meta.max_seen) == (
        "c1",
        common_pb2.STORE_STATE_CLEAN,
        "s-42",
        7,
    )
    store.set_state(common_pb2.STORE_STATE_DIRTY)
    assert (store.meta().state, store.meta().shutdown_id) == (common_pb2.STORE_STATE_DIRTY, "")
    store.set_cluster_id("c1")  # the same id again is fine
    with pytest.raises(ValueError, match="cluster"):
        store.set_cluster_id("c2")
    with pytest.raises(ValueError):
        store.set_state(common_pb2.STORE_STATE_CLEAN)  # CLEAN needs a shutdown id
    assert store.meta().cluster_id == "c1"


def test_epoch_never_decreases(store: Store) -> None:
    store.set_epoch(5)
    with pytest.raises(StaleEpochError):
        store.set_epoch(4)
    store.set_epoch(5)
    assert store.meta().epoch == 5
    # Old entries (epoch 2) do not lower it; an entry of a newer epoch raises it.
    Writer(store, epoch=2).append(epoch_start(2), create("t"))
    assert store.meta().epoch == 5
    Writer(store).append(epoch_start(7), epoch=7)
    assert (store.meta().epoch, store.meta().last_epoch) == (7, 7)
    with pytest.raises(StaleEpochError):
        store.set_epoch(6)


def test_history_records_epoch_boundaries(store: Store) -> None:
    w = Writer(store, epoch=1)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(2)))
    w.append(epoch_start(3), epoch=3)
    w.append(publish("t", 2, payloads(1)), create("u"))
    w.append(epoch_start(4), publish("t", 3, payloads(1)), epoch=4)
    meta = store.meta()
    assert meta.history == (EpochBoundary(1, 1), EpochBoundary(3, 4), EpochBoundary(4, 7))
    assert (meta.last_lsn, meta.last_epoch, meta.epoch) == (8, 4, 4)


# --- append and read back


def test_append_and_read_back(store: Store) -> None:
    w = Writer(store)
    data = common_pb2.EventData(key=b"k1", payload=b"p1", sequence=11, headers={"h": "v"})
    op = publish("orders", 0, [], publisher_id="pub", session_token="tok", timestamp_ms=77)
    op.publish.events.extend([data, common_pb2.EventData(payload=b"p2", sequence=12)])
    entries = w.append(
        epoch_start(1),
        create("orders", created_ms=123),
        create("audit", kind=common_pb2.TOPIC_KIND_TRANSIENT),
        op,
        set_cursor("orders", "billing", 1),
    )
    events = store.read_events("orders", 0, 10)
    assert store.get_topic("orders") == TopicInfo(
        name="orders",
        topic_id=1,
        kind=common_pb2.TOPIC_KIND_REPLICATED,
        next_offset=2,
        first_offset=0,
        created_ms=123,
        # Each stored record: the serialized event and its 4-byte checksum.
        size_bytes=sum(4 + event.ByteSize() for event in events),
    )
    assert [t.name for t in store.list_topics()] == ["audit", "orders"]
    assert store.get_topic("audit") is not None
    assert events[0] == common_pb2.Event(
        topic="orders",
        offset=0,
        key=b"k1",
        payload=b"p1",
        timestamp_ms=77,
        publisher_id="pub",
        sequence=11,
        lsn=4,
        epoch=1,
        session_token="tok",
        headers={"h": "v"},
    )
    assert (events[1].offset, events[1].payload, dict(events[1].headers)) == (1, b"p2", {})
    assert store.get_cursor("orders", "billing") == 1
    assert store.get_cursor("orders", "other") is None
    assert store.list_subscriptions("orders") == [("billing", 1)]
    assert store.read_log(1, 100) == entries
    assert store.read_log(3, 2) == entries[2:4]
    assert store.read_log(6, 10) == []
    meta = store.meta()
    assert (meta.last_lsn, meta.last_epoch, meta.epoch) == (5, 1, 1)


def test_topic_kind_unspecified_means_replicated(store: Store) -> None:
    Writer(store).append(epoch_start(1), create("t", kind=common_pb2.TOPIC_KIND_UNSPECIFIED))
    assert topic(store, "t").kind == common_pb2.TOPIC_KIND_REPLICATED


def test_many_topics_keep_their_events_apart(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("a"), create("b"), create("c"))
    for i in range(3):  # interleaved publishes, older topics after newer ones
        w.append(*(publish(name, i * 2, payloads(2, i * 2)) for name in ("c", "a", "b")))
    for name in ("a", "b", "c"):
        events = store.read_events(name, 0, 100)
        assert [e.offset for e in events] == list(range(6))
        assert {e.topic for e in events} == {name}


# --- refusals: nothing changes


def test_lsn_gap_refused(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    before = observe(store)
    gap = make_entry(w.lsn + 2, 1, publish("t", 0, payloads(1)))
    with pytest.raises(InvalidEntryError, match="LSN 4"):
        store.append([gap], sync=False)
    repeat = make_entry(w.lsn, 1, publish("t", 0, payloads(1)))
    with pytest.raises(InvalidEntryError):
        store.append([repeat], sync=False)
    assert observe(store) == before


def test_bad_checksum_refused(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    before = observe(store)
    (entry,) = w.entries(publish("t", 0, payloads(1)))
    entry.checksum ^= 1
    with pytest.raises(InvalidEntryError, match="checksum"):
        store.append([entry], sync=True)
    assert observe(store) == before


def test_an_operation_of_a_newer_release_is_refused_naming_the_release(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    before = observe(store)
    # Field 999 (varint 1): what this release's Operation knows no field for.
    unknown = b"\xb8\x3e\x01"
    newer = replica_pb2.LogEntry(
        lsn=w.lsn + 1, epoch=1, checksum=zlib.crc32(unknown), operation=unknown
    )
    with pytest.raises(InvalidEntryError, match="newer release wrote it"):
        store.append([newer], sync=False)
    empty = replica_pb2.LogEntry(lsn=w.lsn + 1, epoch=1, checksum=zlib.crc32(b""))
    with pytest.raises(InvalidEntryError, match="no operation"):
        store.append([empty], sync=False)
    assert observe(store) == before


def test_older_epoch_refused(store: Store) -> None:
    w = Writer(store, epoch=3)
    w.append(epoch_start(3), create("t"))
    before = observe(store)
    with pytest.raises(InvalidEntryError, match=r"epoch 2.*older"):
        store.append(w.entries(publish("t", 0, payloads(1)), epoch=2), sync=False)
    assert observe(store) == before


@pytest.mark.parametrize(
    "bad",
    [
        "lsn_gap",
        "checksum",
        "wrong_first_offset",
        "topic_exists",
        "unknown_topic",
        "transient_publish",
        "cursor_beyond_end",
        "no_subscription",
        "no_operation",
        "garbage_operation",
        "epoch_start_mismatch",
        "epoch_start_repeated",
        "subscription_name_empty",
        "publisher_id_too_long",
        "topic_name_too_long",
        "joined_without_parts",
        "joined_part_at_a_wrong_offset",
    ],
)
def test_failing_batch_leaves_nothing(store: Store, bad: str) -> None:
    w = Writer(store)
    w.append(
        epoch_start(1),
        create("t"),
        create("live", kind=common_pb2.TOPIC_KIND_TRANSIENT),
        publish("t", 0, payloads(2), publisher_id="p", sequences=[1, 2]),
        set_cursor("t", "s", 1),
    )
    before = observe(store, ("p", "q"))
    good = [
        create("new"),
        publish("t", 2, payloads(3), publisher_id="p", sequences=[3, 4, 5]),
        set_cursor("t", "s", 4),
        destroy("new"),
        create("new2"),
    ]
    bad_ops = {
        "wrong_first_offset": publish("t", 4, payloads(1)),
        "topic_exists": create("t"),
        "unknown_topic": publish("nope", 0, payloads(1)),
        "transient_publish": publish("live", 0, payloads(1)),
        "cursor_beyond_end": set_cursor("t", "s", 99),
        "no_subscription": delete_subscription("t", "nope"),
        "no_operation": Op(),
        "epoch_start_mismatch": epoch_start(9),
        "epoch_start_repeated": epoch_start(1),
        "subscription_name_empty": set_cursor("t", "", 1),
        "publisher_id_too_long": publish(
            "t", 5, payloads(1), publisher_id="p" * 600, sequences=[1]
        ),
        "topic_name_too_long": create("x" * 600),
        "joined_without_parts": Op(publish_parts=replica_pb2.PublishPartsOp()),
        # The first part alone would apply: the whole joined entry is refused with it.
        "joined_part_at_a_wrong_offset": Op(
            publish_parts=replica_pb2.PublishPartsOp(
                parts=[
                    publish("t", 5, payloads(1), publisher_id="p", sequences=[6]).publish,
                    publish("t", 5, payloads(1), publisher_id="q", sequences=[1]).publish,
                ]
            )
        ),
    }
    entries = w.entries(*good, bad_ops.get(bad, Op()))
    last = entries[-1]
    if bad == "lsn_gap":
        last.lsn += 1
    elif bad == "checksum":
        last.checksum ^= 0xFFFF
    elif bad == "garbage_operation":
        last.operation = b"\xff\xff\xff"
        last.checksum = zlib.crc32(last.operation)
    # What the refusal names, where this test checks it.
    named = {
        "joined_without_parts": "joined publish without parts",
        "joined_part_at_a_wrong_offset": "offset 5",
    }
    with pytest.raises(InvalidEntryError, match=named.get(bad)):
        store.append(entries, sync=True)
    assert observe(store, ("p", "q")) == before
    # The good part alone still applies.
    w.append(*good)
    assert topic(store, "t").next_offset == 5


def test_publish_wrong_first_offset_refused(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(3)))
    for first in (0, 2, 4):
        with pytest.raises(InvalidEntryError, match="offset"):
            store.append(w.entries(publish("t", first, payloads(1))), sync=False)
    w.append(publish("t", 3, payloads(1)))
    assert [e.offset for e in store.read_events("t", 0, 10)] == [0, 1, 2, 3]


# --- deduplication


def test_dedupe_lookup_and_high_water(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("a"), create("b"))
    w.append(publish("a", 0, payloads(3), publisher_id="p1", sequences=[1, 2, 3]))
    w.append(
        publish("b", 0, payloads(2), publisher_id="p1", sequences=[10, 4]),
        publish("b", 2, payloads(1), publisher_id="p2", sequences=[1]),
        publish("b", 3, payloads(1), sequences=[77]),  # no publisher id: no dedupe
        publish("b", 4, payloads(1), publisher_id="p3"),  # sequence 0: no dedupe
    )
    assert store.lookup_sequence("p1", 2) == DedupeHit(topic="a", offset=1, lsn=4, epoch=1)
    assert store.lookup_sequence("p1", 10) == DedupeHit(topic="b", offset=0, lsn=5, epoch=1)
    assert store.lookup_sequence("p1", 4) == DedupeHit(topic="b", offset=1, lsn=5, epoch=1)
    assert store.lookup_sequence("p2", 1) == DedupeHit(topic="b", offset=2, lsn=6, epoch=1)
    assert store.lookup_sequence("p1", 5) is None
    assert store.lookup_sequence("", 77) is None
    assert store.lookup_sequence("p3", 0) is None
    assert store.publisher_high_water("p1") == 10
    assert store.publisher_high_water("p2") == 1
    assert store.publisher_high_water("p3") == 0
    assert store.publisher_high_water("nobody") == 0


def test_dedupe_runs_map_each_sequence_to_its_offset(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    w.append(publish("t", 0, payloads(3), publisher_id="p", sequences=[5, 6, 7]))
    w.append(publish("t", 3, payloads(2), publisher_id="p", sequences=[1, 2]))
    # A sequence-less event breaks a run: 10 and 11 are not at consecutive offsets.
    w.append(publish("t", 5, payloads(4), publisher_id="p", sequences=[10, 0, 11, 12]))
    expected = {5: 0, 6: 1, 7: 2, 1: 3, 2: 4, 10: 5, 11: 7, 12: 8}
    for sequence in range(1, 15):
        hit = store.lookup_sequence("p", sequence)
        offset = expected.get(sequence)
        assert (hit.offset if hit else None) == offset, sequence
        if hit:
            assert store.read_events("t", hit.offset, 1)[0].sequence == sequence


def test_sequence_stored_twice_refused(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    w.append(publish("t", 0, payloads(3), publisher_id="p", sequences=[4, 5, 6]))
    before = observe(store, ("p",))
    for sequences in ([5], [6, 7], [2, 3, 4], [1, 2, 3, 4, 5, 6, 7]):
        ops = publish("t", 3, payloads(len(sequences)), publisher_id="p", sequences=sequences)
        with pytest.raises(InvalidEntryError, match="already stored"):
            store.append(w.entries(ops), sync=False)
        assert observe(store, ("p",)) == before
    # Lower, disjoint sequences are fine (the master decides what is new).
    w.append(publish("t", 3, payloads(2), publisher_id="p", sequences=[2, 3]))
    assert store.lookup_sequence("p", 3) == DedupeHit("t", 4, w.lsn, 1)


def test_dedupe_publishers_with_prefix_ids_stay_apart(make_store: StoreFactory) -> None:
    store = make_store(dedupe_window=5)
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    w.append(publish("t", 0, payloads(3), publisher_id="ab", sequences=[1, 2, 3]))
    # "a" is a prefix of "ab"; pruning "a" must not touch "ab"'s records.
    w.append(publish("t", 3, payloads(1), publisher_id="a", sequences=[100]))
    assert [store.lookup_sequence("ab", s) is not None for s in (1, 2, 3)] == [True] * 3


def test_dedupe_pruning(make_store: StoreFactory) -> None:
    store = make_store(dedupe_window=10)
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    w.append(publish("t", 0, payloads(5), publisher_id="p", sequences=[1, 2, 3, 4, 5]))
    w.append(publish("t", 5, payloads(1), publisher_id="q", sequences=[1]))
    assert all(store.lookup_sequence("p", s) for s in range(1, 6))
    # High water 13: sequences at or below 13 - 10 = 3 are pruned, the rest kept.
    w.append(publish("t", 6, payloads(2), publisher_id="p", sequences=[12, 13]))
    assert store.publisher_high_water("p") == 13
    assert [store.lookup_sequence("p", s) is not None for s in range(1, 6)] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert store.lookup_sequence("p", 13) is not None
    assert store.lookup_sequence("q", 1) is not None  # other publishers untouched
    # Within one batch: the final high water decides.
    w.append(
        publish("t", 8, payloads(1), publisher_id="p", sequences=[20]),
        publish("t", 9, payloads(1), publisher_id="p", sequences=[30]),
    )
    assert store.lookup_sequence("p", 20) is None
    assert store.lookup_sequence("p", 13) is None
    assert store.lookup_sequence("p", 30) == DedupeHit("t", 9, w.lsn, 1)


# --- a topic's incarnation: destroying a topic forgets its publishers' sequences


def dedupe_state(store: Store, publisher_id: str, top: int = 10) -> tuple[Any, ...]:
    """The publisher's high-water mark and where each of its first sequences went."""
    return store.publisher_high_water(publisher_id), [
        store.lookup_sequence(publisher_id, s) for s in range(1, top + 1)
    ]


def test_recreated_topic_starts_with_no_dedupe_state(store: Store) -> None:
    """The issue's reproduction, at the store: the same publisher id and sequences in a
    re-created topic are new events, stored at offsets 0, 1, 2."""
    w = Writer(store)
    w.append(epoch_start(1), create("dd"))
    w.append(publish("dd", 0, payloads(3), publisher_id="pub-fixed", sequences=[1, 2, 3]))
    assert store.lookup_sequence("pub-fixed", 2) == DedupeHit("dd", 1, w.lsn, 1)
    w.append(destroy("dd"))
    assert dedupe_state(store, "pub-fixed") == (0, [None] * 10)
    assert store.counts()["dedupe"] == 0
    w.append(create("dd"))
    assert dedupe_state(store, "pub-fixed") == (0, [None] * 10)
    ops = publish("dd", 0, payloads(3, start=10), publisher_id="pub-fixed", sequences=[1, 2, 3])
    w.append(ops)
    events = store.read_events("dd", 0, 10)
    assert [(e.offset, e.sequence, e.payload) for e in events] == [
        (0, 1, b"event-10"),
        (1, 2, b"event-11"),
        (2, 3, b"event-12"),
    ]
    assert store.lookup_sequence("pub-fixed", 3) == DedupeHit("dd", 2, w.lsn, 1)
    assert store.publisher_high_water("pub-fixed") == 3


def test_destroy_keeps_a_publishers_state_in_its_other_topics(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("a"), create("b"))
    w.append(publish("a", 0, payloads(3), publisher_id="p", sequences=[1, 2, 3]))
    w.append(publish("b", 0, payloads(2), publisher_id="p", sequences=[4, 5]))
    w.append(publish("a", 3, payloads(1), publisher_id="q", sequences=[7]))
    w.append(destroy("a"))
    high, hits = dedupe_state(store, "p", 5)
    # Sequences are one space per publisher: the mark stays while "b" holds some.
    assert high == 5
    assert hits[:3] == [None] * 3
    assert [h.topic if h else None for h in hits[3:]] == ["b", "b"]
    assert dedupe_state(store, "q") == (0, [None] * 10)  # q wrote only to "a"
    w.append(create("a"))
    w.append(publish("a", 0, payloads(3), publisher_id="p", sequences=[1, 2, 3]))
    assert store.lookup_sequence("p", 1) == DedupeHit("a", 0, w.lsn, 1)
    w.append(destroy("b"))
    assert dedupe_state(store, "p", 5)[0] == 5  # p still has the new "a"
    w.append(destroy("a"))
    assert dedupe_state(store, "p", 5) == (0, [None] * 5)
    assert store.counts()["dedupe"] == 0
    assert store.counts()["publishers"] == 0  # no mark and no index entry is left


def test_destroy_and_recreate_with_the_same_sequences_in_one_batch(store: Store) -> None:
    w = Writer(store)
    w.append(
        epoch_start(1),
        create("t"),
        publish("t", 0, payloads(3), publisher_id="p", sequences=[1, 2, 3]),
        destroy("t"),
        create("t"),
        publish("t", 0, payloads(2, start=5), publisher_id="p", sequences=[1, 2]),
    )
    assert [e.payload for e in store.read_events("t", 0, 10)] == [b"event-5", b"event-6"]
    assert dedupe_state(store, "p", 3) == (
        2,
        [DedupeHit("t", 0, w.lsn, 1), DedupeHit("t", 1, w.lsn, 1), None],
    )


def test_a_reader_of_a_destroyed_incarnation_never_reads_the_next(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(2)))
    old_id = topic(store, "t").topic_id
    assert len(store.read_events("t", 0, 10, topic_id=old_id)) == 2
    w.append(destroy("t"), create("t"), publish("t", 0, payloads(3, start=50)))
    with pytest.raises(UnknownTopicError, match="destroyed"):
        store.read_events("t", 0, 10, topic_id=old_id)
    new_id = topic(store, "t").topic_id
    assert [e.payload for e in store.read_events("t", 2, 10, topic_id=new_id)] == [b"event-52"]


def _drop_incarnation_index(store: Store) -> None:
    """Makes the store look written by the version before the index: dedupe records and
    high-water marks only (the index keys start with a 0 byte)."""
    with store._kv.write(sync=False) as txn:  # building an old store
        txn.delete_range("publishers", b"\x00", b"\x01")


def test_stale_dedupe_records_of_an_older_store_are_fenced_off(store: Store) -> None:
    """A store written before destroys removed dedupe state keeps records naming a
    destroyed incarnation: they are no hit, and a publish of their sequences replaces
    them instead of being refused."""
    w = Writer(store)
    w.append(epoch_start(1), create("dd"), create("other"))
    w.append(publish("dd", 0, payloads(3), publisher_id="pub-fixed", sequences=[1, 2, 3]))
    w.append(publish("other", 0, payloads(2), publisher_id="pub-fixed", sequences=[8, 9]))
    _drop_incarnation_index(store)
    w.append(destroy("dd"))
    assert store.counts()["dedupe"] == 2  # the old version's leftovers (the index is gone)
    assert dedupe_state(store, "pub-fixed", 3) == (9, [None] * 3)
    w.append(create("dd"))
    assert dedupe_state(store, "pub-fixed", 3) == (9, [None] * 3)
    w.append(publish("dd", 0, payloads(2, start=20), publisher_id="pub-fixed", sequences=[1, 2]))
    assert store.lookup_sequence("pub-fixed", 2) == DedupeHit("dd", 1, w.lsn, 1)
    assert store.lookup_sequence("pub-fixed", 3) is None  # the stale run 1..3 is gone
    assert store.lookup_sequence("pub-fixed", 9) == DedupeHit("other", 1, 5, 1)
    # A live run is still refused.
    with pytest.raises(InvalidEntryError, match="already stored"):
        store.append(
            w.entries(publish("dd", 2, payloads(1), publisher_id="pub-fixed", sequences=[2])),
            sync=False,
        )


# --- cursors and subscriptions


def test_cursor_forward_only(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(10)))
    w.append(set_cursor("t", "s", 5))
    w.append(set_cursor("t", "s", 3))  # a late, out-of-order ack: ignored
    assert store.get_cursor("t", "s") == 5
    w.append(set_cursor("t", "s", 8), set_cursor("t", "s", 7))
    assert store.get_cursor("t", "s") == 8
    w.append(set_cursor("t", "a", 0), set_cursor("t", "z", 10))
    assert store.list_subscriptions("t") == [("a", 0), ("s", 8), ("z", 10)]
    w.append(delete_subscription("t", "s"))
    assert store.get_cursor("t", "s") is None
    assert store.list_subscriptions("t") == [("a", 0), ("z", 10)]
    w.append(set_cursor("t", "s", 2))  # created again from scratch
    assert store.get_cursor("t", "s") == 2


def test_destroy_removes_events_and_cursors(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), create("keep"))
    w.append(publish("t", 0, payloads(4)), publish("keep", 0, payloads(2)))
    w.append(set_cursor("t", "s", 2), set_cursor("keep", "s", 1))
    old_id = topic(store, "t").topic_id
    w.append(destroy("t"))
    assert store.get_topic("t") is None
    assert [t.name for t in store.list_topics()] == ["keep"]
    assert store.get_cursor("t", "s") is None
    with pytest.raises(UnknownTopicError):
        store.read_events("t", 0, 10)
    w.append(create("t"))
    again = topic(store, "t")
    assert (again.next_offset, again.first_offset) == (0, 0)
    assert again.topic_id != old_id
    assert store.read_events("t", 0, 10) == []
    assert store.list_subscriptions("t") == []
    w.append(publish("t", 0, payloads(1, start=100)))
    assert [e.payload for e in store.read_events("t", 0, 10)] == [b"event-100"]
    # The other topic is untouched.
    assert len(store.read_events("keep", 0, 10)) == 2
    assert store.get_cursor("keep", "s") == 1


def test_destroy_and_create_in_one_batch(store: Store) -> None:
    w = Writer(store)
    w.append(
        epoch_start(1),
        create("t"),
        publish("t", 0, payloads(3)),
        destroy("t"),
        create("t"),
        publish("t", 0, payloads(1, start=9)),
    )
    assert [e.payload for e in store.read_events("t", 0, 10)] == [b"event-9"]


# --- reads


def test_read_events_bounds(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(10)))

    def offsets(*args: int, **kwargs: int) -> list[int]:
        return [e.offset for e in store.read_events("t", *args, **kwargs)]

    assert offsets(0, 100) == list(range(10))
    assert offsets(10, 100) == []  # at the end
    assert offsets(50, 100) == []  # beyond the end
    assert offsets(3, 4) == [3, 4, 5, 6]  # max_events
    assert offsets(3, 100, 5) == [3, 4]  # end_offset is exclusive
    assert offsets(3, 100, 3) == []
    assert offsets(8, 100, 50) == [8, 9]  # end_offset beyond the end
    # The byte bound counts each event as it goes on the wire (services/replica/batch_bytes.py).
    three = sum(framed_event_bytes(e.ByteSize()) for e in store.read_events("t", 0, 3))
    assert offsets(0, 100, max_bytes=three) == [0, 1, 2]
    assert offsets(0, 100, max_bytes=three - 1) == [0, 1]
    assert offsets(0, 100, max_bytes=1) == [0]  # at least one event
    with pytest.raises(ValueError):
        store.read_events("t", 0, 0)
    with pytest.raises(UnknownTopicError):
        store.read_events("nope", 0, 10)
    with pytest.raises(UnknownTopicError):
        store.list_subscriptions("nope")


def test_an_append_sees_what_another_writer_changed_since_the_last(store: Store) -> None:
    """The store keeps what its last append left (the log tail, epoch, history) for the
    next; a write by anyone else in between (another Store over the same KV here) must
    be seen, never the kept copy."""
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    other = Store(store._kv)  # another writer of the same databases
    Writer(other).append(epoch_start(2), publish("t", 0, payloads(1)), epoch=2)
    stale = make_entry(3, 1, publish("t", 0, payloads(1)))
    with pytest.raises(InvalidEntryError, match="does not follow the last LSN 4"):
        store.append([stale], sync=False)
    store.append([make_entry(5, 2, publish("t", 1, payloads(1)))], sync=False)
    meta = store.meta()
    assert (meta.last_lsn, meta.last_epoch, meta.epoch) == (5, 2, 2)
    assert [(b.epoch, b.start_lsn) for b in meta.history] == [(1, 1), (2, 3)]
    assert [e.payload for e in store.read_events("t", 0, 10)] == [b"event-0", b"event-0"]


def test_a_write_transaction_knows_the_state_it_began_from(store: Store) -> None:
    """``WriteTxn.generation``: one more per transaction that commits a change, the same
    after an abort."""
    kv = store._kv
    with kv.write(sync=False) as txn:
        first = txn.generation()
        txn.put("meta", b"probe", b"1")
    with pytest.raises(RuntimeError), kv.write(sync=False) as txn:
        assert txn.generation() == first + 1
        txn.put("meta", b"probe", b"2")
        raise RuntimeError("aborted")
    with kv.write(sync=True) as txn:
        assert txn.generation() == first + 1
        txn.put("meta", b"probe", b"3")
    with kv.write(sync=False) as txn:
        assert txn.generation() == first + 2


def test_read_log_bounds(store: Store) -> None:
    w = Writer(store)
    entries = w.append(epoch_start(1), create("t"), publish("t", 0, payloads(1)))
    assert store.read_log(1, 2) == entries[:2]
    assert store.read_log(3, 100) == entries[2:]
    assert store.read_log(4, 100) == []
    with pytest.raises(ValueError):
        store.read_log(0, 10)


# --- log retention


def test_compaction_moves_the_log_start(store: Store) -> None:
    w = Writer(store)
    entries = w.append(epoch_start(1), create("t"))
    entries += w.append(*(publish("t", i, payloads(1, i)) for i in range(18)))
    assert store.compact_log(8, batch_entries=3) == 7  # LSNs 1..7, three transactions
    assert (store.log_start_lsn(), store.meta().log_start_lsn) == (8, 8)
    with pytest.raises(LogCompactedError, match=r"LSN 7\b.*starts at LSN 8") as error:
        store.read_log(7, 10)
    assert (error.value.from_lsn, error.value.log_start_lsn) == (7, 8)
    with pytest.raises(LogCompactedError):
        store.read_log(1, 1)
    assert store.read_log(8, 100) == entries[7:]
    # The state the compacted entries built is untouched.
    assert [e.offset for e in store.read_events("t", 0, 100)] == list(range(18))
    assert store.compact_log(8) == 0  # idempotent
    assert store.compact_log(5) == 0  # an older point changes nothing
    assert store.log_start_lsn() == 8


def test_compaction_keeps_the_last_entry(store: Store) -> None:
    assert store.compact_log(100) == 0  # an empty log has nothing to delete
    w = Writer(store)
    entries = w.append(epoch_start(1), create("t"), publish("t", 0, payloads(3)))
    assert store.compact_log(1_000_000) == 2
    assert store.log_start_lsn() == 3
    assert store.read_log(3, 10) == entries[2:]
    assert store.compact_log(1_000_000) == 0
    with pytest.raises(ValueError):
        store.compact_log(0)
    with pytest.raises(ValueError):
        store.compact_log(3, batch_entries=0)


def test_appends_continue_after_compaction(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(2)))
    store.compact_log(w.lsn + 1)
    more = w.append(publish("t", 2, payloads(2)))
    more += w.append(epoch_start(2), epoch=2)
    meta = store.meta()
    assert (meta.last_lsn, meta.last_epoch, meta.log_start_lsn) == (5, 2, 3)
    assert meta.history == (EpochBoundary(1, 1), EpochBoundary(2, 5))
    assert store.read_log(4, 10) == more
    assert store.compact_log(w.lsn) == 2
    assert store.read_log(5, 10) == more[1:]
    assert len(store.read_events("t", 0, 10)) == 4


def test_make_entry_fills_checksum() -> None:
    entry = make_entry(7, 2, create("t"))
    assert (entry.lsn, entry.epoch) == (7, 2)
    assert entry.checksum == zlib.crc32(entry.operation)
    assert replica_pb2.Operation.FromString(entry.operation) == create("t")


def test_reads_see_whole_batches_while_writing(store: Store) -> None:
    """A reader in another thread never sees part of a batch."""
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    batch_events, batches = 7, 60
    seen: list[int] = []
    failures: list[str] = []
    done = threading.Event()

    def reader() -> None:
        deadline = time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline:
            count = len(store.read_events("t", 0, 100_000))
            if count % batch_events:
                failures.append(f"saw {count} events")
            seen.append(count)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(batches):
            ops = [publish("t", i * batch_events + j, payloads(1)) for j in range(batch_events)]
            w.append(*ops)
    finally:
        done.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert failures == []
    assert seen and seen == sorted(seen)  # monotonic: committed state never goes back


# --- memory twin capacity (LMDB's map full is in test_store_lmdb.py)


def test_memory_capacity_full_leaves_store_intact() -> None:
    store = Store.open_memory(capacity_bytes=20_000)
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(5)))
    before = observe(store)
    big = publish("t", 5, [b"x" * 1000] * 30)
    with pytest.raises(StoreFullError):
        store.append(w.entries(big), sync=True)
    assert observe(store) == before
    w.append(publish("t", 5, payloads(2)))  # a smaller write still fits
    assert len(store.read_events("t", 0, 100)) == 7


def test_counts_are_records_per_database(store: Store) -> None:
    """What `squall store inspect` shows, counted without a scan."""
    assert store.counts() == {
        "meta": 0,
        "log": 0,
        "topics": 0,
        "events": 0,
        "cursors": 0,
        "dedupe": 0,
        "publishers": 0,
        "push": 0,
        "shared": 0,
        "links": 0,
    }
    w = Writer(store)
    w.append(
        epoch_start(1),
        create("orders"),
        publish("orders", 0, payloads(3), publisher_id="p", sequences=[1, 2, 3]),
        set_cursor("orders", "billing", 1),
    )
    counts = store.counts()
    assert (counts["log"], counts["topics"], counts["events"], counts["cursors"]) == (4, 1, 3, 1)
    assert (counts["dedupe"], counts["publishers"]) == (1, 1)


class _BreakingReads:
    """Wraps a store's KV: its read transactions fail every get with `error` (or fail to
    open at all), and the ones closed are counted."""

    def __init__(self, kv: Any, error: Exception, *, at_open: bool = False) -> None:
        self._kv, self.error, self.at_open, self.closed = kv, error, at_open, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def read(self) -> Any:
        if self.at_open:
            raise self.error
        return _BrokenRead(self, self._kv.read())


class _BrokenRead:
    def __init__(self, owner: _BreakingReads, inner: Any) -> None:
        self._owner, self._inner = owner, inner

    def __enter__(self) -> _BrokenRead:
        self._txn = self._inner.__enter__()
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def get(self, db: str, key: bytes) -> bytes | None:
        raise self._owner.error

    def __exit__(self, *exc: Any) -> Any:
        self._owner.closed += 1
        return self._inner.__exit__(*exc)


@pytest.mark.parametrize("at_open", [False, True], ids=["in-the-read", "opening-it"])
def test_a_kv_failure_in_a_read_is_a_store_error_and_the_read_is_closed(
    make_store: StoreFactory, at_open: bool
) -> None:
    """Damage the engine reports becomes CorruptRecordError naming the database, any other
    engine error StoreError ("read failed"); a read that began is closed either way."""
    from squall_server.replica.store import CorruptRecordError, StoreError
    from squall_server.replica.store.kv import KVCorruptError, KVError

    store = make_store()
    kv = store._kv  # type: ignore[attr-defined]
    for error, raised in (
        (KVCorruptError("topics", "bad page"), CorruptRecordError),
        (KVError("I/O error"), StoreError),
    ):
        broken = _BreakingReads(kv, error, at_open=at_open)
        store._kv = broken  # type: ignore[attr-defined]
        with pytest.raises(StoreError) as caught:
            store.get_topic("t")
        assert caught.type is raised
        assert ("bad page" if raised is CorruptRecordError else "read failed") in str(caught.value)
        assert broken.closed == (0 if at_open else 1)
    store._kv = kv  # type: ignore[attr-defined]
    assert store.get_topic("t") is None
