"""Snapshot export and install, run against both store twins (LMDB and in-memory).

A snapshot must carry a replica's whole state as of one LSN, whatever is written while
it is read, and an install must either finish with exactly that state, swapped in by one
transaction, or leave the store with the state and log it held before (the install
staged apart, resumable or dropped). Chunks go through
protobuf serialization here, as they would on the replication stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.store import (
    SNAPSHOT_DBS,
    CorruptRecordError,
    EpochBoundary,
    InvalidEntryError,
    LogCompactedError,
    SnapshotError,
    Store,
    StoreFullError,
)
from squall_server.replica.store.records import STAGED_DBS, clear_state
from squall_server.replica.store.snapshot import PendingInstall
from tests.unit.test_store_contract import (
    Op,
    Writer,
    create,
    delete_subscription,
    destroy,
    epoch_start,
    payloads,
    publish,
    set_cursor,
)

PUBLISHERS = ("p", "q", "r")
Chunk = replica_pb2.SnapshotChunk


class Stores:
    """Opens stores of one twin; ``reopen`` restarts an LMDB store from its files."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.open: list[Store] = []
        self.paths: dict[int, Path] = {}

    def make(self) -> Store:
        """A new, empty store."""
        if self.kind == "memory":
            store = Store.open_memory()
        else:
            path = self.tmp_path / f"store-{len(self.paths)}"
            store = Store.open_lmdb(path, 256 << 20)
            self.paths[id(store)] = path
        self.open.append(store)
        return store

    def reopen(self, store: Store) -> Store:
        """The store after a restart. The memory twin cannot restart: the same store
        stands in (what a restart reads is its KV, which the store left as it is)."""
        if self.kind == "memory":
            return store
        path = self.paths.pop(id(store))
        store.close()
        again = Store.open_lmdb(path, 256 << 20)
        self.paths[id(again)] = path
        self.open.append(again)
        return again


@pytest.fixture(params=["memory", "lmdb"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """Stores of the parametrized twin, closed at the end."""
    made = Stores(request.param, tmp_path)
    yield made
    for store in made.open:
        store.close()


# --- building state


def fill(store: Store) -> Writer:
    """Two epochs of topics, events, cursors and dedupe records (a destroyed topic too)."""
    w = Writer(store)
    w.append(epoch_start(1), create("orders", created_ms=11), create("gone"))
    keyed = publish("orders", 0, [], publisher_id="p", session_token="s1", timestamp_ms=9)
    keyed.publish.events.extend(
        common_pb2.EventData(key=b"k%d" % i, payload=b"v%d" % i, sequence=i + 1, headers={"h": "x"})
        for i in range(5)
    )
    w.append(keyed, publish("gone", 0, payloads(3)), set_cursor("gone", "s", 1))
    w.append(create("audit", kind=common_pb2.TOPIC_KIND_TRANSIENT), destroy("gone"))
    w.append(epoch_start(3), epoch=3)
    w.append(
        create("metrics"),
        publish("metrics", 0, payloads(40), publisher_id="q", sequences=list(range(1, 41))),
        publish("orders", 5, payloads(2), publisher_id="p", sequences=[9, 10]),
        publish("orders", 7, payloads(1), publisher_id="r", sequences=[1]),
        set_cursor("orders", "billing", 4),
        set_cursor("orders", "audit", 7),
        set_cursor("metrics", "dash", 30),
        set_cursor("metrics", "old", 3),
        delete_subscription("metrics", "old"),
    )
    return w


def more_ops(store: Store) -> list[Op]:
    """Operations that continue any store fill() built, touching every kind of state."""
    orders = store.get_topic("orders")
    metrics = store.get_topic("metrics")
    assert orders is not None and metrics is not None
    return [
        create("fresh"),
        publish("fresh", 0, payloads(3), publisher_id="p", sequences=[11, 12, 13]),
        publish("orders", orders.next_offset, payloads(2), publisher_id="q", sequences=[41, 42]),
        set_cursor("orders", "billing", orders.next_offset + 1),
        set_cursor("fresh", "new", 2),
        destroy("metrics"),
        create("metrics"),
        publish("metrics", 0, payloads(1)),
    ]


def view(store: Store) -> tuple[Any, ...]:
    """Everything a reader can see of the state and of the log's position."""
    meta = store.meta()
    topics = store.list_topics()
    events = {t.name: store.read_events(t.name, 0, 100_000) for t in topics}
    subscriptions = {t.name: store.list_subscriptions(t.name) for t in topics}
    cursors = {
        (t.name, name): store.get_cursor(t.name, name)
        for t in topics
        for name, _ in subscriptions[t.name]
    }
    dedupe = {
        p: (store.publisher_high_water(p), [store.lookup_sequence(p, s) for s in range(0, 50)])
        for p in PUBLISHERS
    }
    gets = {t.name: store.get_topic(t.name) for t in topics}
    position = (meta.last_lsn, meta.last_epoch, meta.history)
    return position, topics, gets, events, subscriptions, cursors, dedupe


def wire(chunk: Chunk) -> Chunk:
    """The chunk as the receiver parses it off the stream."""
    return Chunk.FromString(chunk.SerializeToString())


def install(target: Store, chunks: list[Chunk]) -> None:
    """Installs a whole snapshot, as the slave's driver does."""
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        target.install_chunk(wire(chunk))
    target.finish_snapshot(chunks[-1].history)


def export(source: Store, **limits: int) -> list[Chunk]:
    """Every chunk of a snapshot of source."""
    with closing(source.snapshot_chunks(**limits)) as chunks:
        return list(chunks)


def append_both(stores: tuple[Store, ...], writer_lsn: int, ops: list[Op], epoch: int) -> int:
    """Appends the same entries to every store; returns the new last LSN."""
    writer = Writer(stores[0], epoch=epoch)
    writer.lsn = writer_lsn
    entries = writer.entries(*ops)
    for store in stores:
        store.append(entries, sync=False)
    return writer_lsn + len(entries)


# --- export


def test_chunks_carry_every_state_record_and_nothing_else(stores: Stores) -> None:
    source = stores.make()
    source.set_cluster_id("cluster-a")
    source.set_max_seen(9)
    w = fill(source)
    chunks = export(source, records_max=7)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert len(chunks) > 3
    assert all(len(c.records) <= 7 for c in chunks)
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert {(c.snapshot_lsn, c.snapshot_epoch) for c in chunks} == {(w.lsn, 3)}
    assert [list(c.history) for c in chunks[:-1]] == [[]] * (len(chunks) - 1)
    assert [(b.epoch, b.start_lsn) for b in chunks[-1].history] == [(1, 1), (3, 9)]
    records = [r for c in chunks for r in c.records]
    dbs = [r.db for r in records]
    assert set(dbs) <= set(SNAPSHOT_DBS) and "log" not in dbs
    assert dbs == sorted(dbs, key=SNAPSHOT_DBS.index)  # database by database, in order
    assert [r.key for r in records if r.db == "meta"] == [b"next_topic_id"]
    # 5 + 2 + 1 orders events, 40 metrics events; the destroyed topic's are gone.
    assert dbs.count("events") == 48
    assert dbs.count("topics") == 3
    assert dbs.count("cursors") == 3
    # 3 high-water marks (p, q, r), and 2 index records per (publisher, topic) pair:
    # p and r in orders, q in metrics (p's pair with the destroyed topic is gone).
    marks = [r.key for r in records if r.db == "publishers" and not r.key.startswith(b"\x00")]
    assert marks == [b"p", b"q", b"r"]
    assert dbs.count("publishers") == 3 + 2 * 3
    for db in SNAPSHOT_DBS:
        keys = [r.key for r in records if r.db == db]
        assert keys == sorted(set(keys))


def test_chunks_stay_within_bytes_max(stores: Stores) -> None:
    source = stores.make()
    w = fill(source)
    big = [b"x" * 3000, b"y" * 10, b"z" * 9000, b"w" * 500]
    w.append(publish("orders", 8, big))
    bytes_max = 4096
    chunks = export(source, records_max=1000, bytes_max=bytes_max)
    for chunk in chunks:
        # Only a record bigger than the limit alone may exceed it, alone in its chunk.
        assert chunk.ByteSize() <= bytes_max or len(chunk.records) == 1
    assert any(c.ByteSize() > bytes_max for c in chunks)  # the 9000-byte event
    assert sum(len(c.records) for c in chunks) == sum(len(c.records) for c in export(source))


def test_empty_store_exports_one_empty_last_chunk(stores: Stores) -> None:
    (chunk,) = export(stores.make())
    assert (chunk.index, chunk.last, len(chunk.records), chunk.snapshot_lsn) == (0, True, 0, 0)
    target = stores.make()
    fill(target)
    install(target, [chunk])
    assert view(target) == view(stores.make())
    assert target.log_start_lsn() == 1
    assert Writer(target).append(epoch_start(1), create("t"))  # the log starts at LSN 1


def test_export_arguments_are_checked(stores: Stores) -> None:
    store = stores.make()
    with pytest.raises(ValueError):
        store.snapshot_chunks(records_max=0)
    with pytest.raises(ValueError):
        store.snapshot_chunks(bytes_max=0)


# --- export then install


@pytest.mark.parametrize("records_max", [1, 5, 1000])
def test_install_into_empty_store_then_continue(stores: Stores, records_max: int) -> None:
    source, target = stores.make(), stores.make()
    w = fill(source)
    install(target, export(source, records_max=records_max))
    assert view(target) == view(source)
    meta = target.meta()
    assert (meta.log_start_lsn, meta.snapshot_pending, meta.epoch) == (w.lsn + 1, False, 3)
    assert target.read_log(w.lsn + 1, 10) == []
    with pytest.raises(LogCompactedError):
        target.read_log(w.lsn, 10)
    # The same entries from snapshot_lsn + 1 on, on both: the same state (topic ids too).
    lsn = append_both((source, target), w.lsn, more_ops(source), epoch=3)
    lsn = append_both((source, target), lsn, [epoch_start(4), create("later")], epoch=4)
    assert view(target) == view(source)
    assert target.read_log(w.lsn + 1, 100) == source.read_log(w.lsn + 1, 100)
    assert target.meta().history == (
        EpochBoundary(1, 1),
        EpochBoundary(3, 9),
        EpochBoundary(4, lsn - 1),
    )


def test_install_replaces_other_data(stores: Stores) -> None:
    source, target = stores.make(), stores.make()
    w = fill(source)
    # The target has its own history: other topics, a longer log, newer node meta.
    target.set_cluster_id("cluster-a")
    target.set_state(common_pb2.STORE_STATE_DIRTY)
    target.set_epoch(7)
    target.set_max_seen(12)
    other = Writer(target, epoch=2)
    other.append(epoch_start(2), create("orders"), create("zzz"), create("a", created_ms=1))
    other.append(*(publish("zzz", i, payloads(1)) for i in range(60)))
    other.append(publish("orders", 0, payloads(2), publisher_id="p", sequences=[20, 21]))
    other.append(set_cursor("zzz", "s", 5), set_cursor("orders", "billing", 1))
    target.compact_log(30)
    install(target, export(source, records_max=10))
    assert view(target) == view(source)
    meta = target.meta()
    # The node's own meta stays; the epoch never goes back.
    assert (meta.cluster_id, meta.state, meta.epoch, meta.max_seen) == (
        "cluster-a",
        common_pb2.STORE_STATE_DIRTY,
        7,
        12,
    )
    assert meta.log_start_lsn == w.lsn + 1
    lsn = append_both((source, target), w.lsn, more_ops(source), epoch=3)
    assert view(target) == view(source)
    assert target.read_log(w.lsn + 1, 100) == source.read_log(w.lsn + 1, lsn)


def test_install_raises_a_lower_epoch(stores: Stores) -> None:
    source, target = stores.make(), stores.make()
    fill(source)
    install(target, export(source))
    assert (target.meta().epoch, target.meta().last_epoch) == (3, 3)


def test_snapshot_of_an_installed_store(stores: Stores) -> None:
    first, second, third = stores.make(), stores.make(), stores.make()
    fill(first)
    install(second, export(first, records_max=3))
    install(third, export(second, records_max=4))
    assert view(third) == view(first)
    assert third.log_start_lsn() == second.log_start_lsn()


def test_snapshot_reflects_its_lsn_while_appends_go_on(stores: Stores) -> None:
    source, target, reference = stores.make(), stores.make(), stores.make()
    w = fill(source)
    reference.append(source.read_log(1, 1000), sync=False)
    snapshot_lsn = w.lsn
    orders = source.get_topic("orders")
    assert orders is not None
    offset = orders.next_offset
    chunks: list[Chunk] = []
    with closing(source.snapshot_chunks(records_max=4)) as gen:
        for i, chunk in enumerate(gen):
            chunks.append(chunk)
            # Between every chunk read, the writer changes every kind of state.
            w.append(
                publish(
                    "orders",
                    offset,
                    payloads(2),
                    publisher_id="r",
                    sequences=[2 + 2 * i, 3 + 2 * i],
                ),
                set_cursor("orders", "billing", offset),
                create(f"new-{i}"),
                set_cursor("orders", f"sub-{i}", 1),
            )
            offset += 2
            if i == 3:
                w.append(destroy("metrics"))
                w.append(epoch_start(5), epoch=5)
    assert len(chunks) > 10
    assert {c.snapshot_lsn for c in chunks} == {snapshot_lsn}
    assert source.meta().last_lsn > snapshot_lsn + 20
    install(target, chunks)
    assert view(target) == view(reference)
    assert target.meta().last_lsn == snapshot_lsn
    # And the log from snapshot_lsn + 1 brings it level with the source.
    target.append(source.read_log(snapshot_lsn + 1, 1000), sync=False)
    assert view(target) == view(source)


def test_closing_an_export_early_releases_it(stores: Stores) -> None:
    source = stores.make()
    w = fill(source)
    for _ in range(300):  # more exports than LMDB has reader slots
        gen = source.snapshot_chunks(records_max=2)
        assert next(gen).index == 0
        gen.close()
    w.append(publish("orders", 8, payloads(1)))
    assert source.meta().last_lsn == w.lsn
    assert len(export(source)) == 1


# --- interrupted and refused installs


def staged_records(store: Store) -> int:
    """Records in the staging databases (the store's own: read through its KV)."""
    with store._kv.read() as txn:
        return sum(txn.count(db) for db in STAGED_DBS.values())


def old_state(store: Store) -> Writer:
    """A store with state of its own, other than fill()'s: what an install replaces."""
    store.set_cluster_id("cluster-a")
    store.set_epoch(4)
    old = Writer(store, epoch=2)
    old.append(epoch_start(2), create("old"), publish("old", 0, payloads(5)))
    old.append(set_cursor("old", "s", 2), publish("old", 5, payloads(2), publisher_id="p"))
    store.record_commit(old.lsn)
    return old


def test_interrupted_install_keeps_the_old_state_and_resumes(stores: Stores) -> None:
    """Regression (docs/status.md): a slave emptied its store for a snapshot, its master
    crashed mid-install, and the emptied slaves elected each other and lost every
    committed event. Until the last chunk is in and finish_snapshot swaps it in, the store
    keeps, serves and reports what it held, across a restart too."""
    source, target = stores.make(), stores.make()
    w = fill(source)
    old = old_state(target)
    before, meta_before = view(target), target.meta()
    log_before = target.read_log(1, 100)
    chunks = export(source, records_max=6)
    assert len(chunks) > 5
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks[:4]:
        target.install_chunk(wire(chunk))
    for _ in range(2):  # before and after a restart
        meta = target.meta()
        assert meta.snapshot_pending
        assert meta == replace(meta_before, snapshot_pending=True)
        assert (meta.last_lsn, meta.last_epoch) == (old.lsn, 2)
        assert view(target) == before
        assert [e.offset for e in target.read_events("old", 0, 10)] == list(range(7))
        assert target.read_log(1, 100) == log_before
        assert target.get_topic("orders") is None  # nothing staged shows
        assert staged_records(target) > 0
        target = stores.reopen(target)
    # The install resumes at the next chunk; the old state stays until the last is in.
    with pytest.raises(SnapshotError, match="next chunk expected is 4"):
        target.install_chunk(wire(chunks[3]))
    for chunk in chunks[4:]:
        target.install_chunk(wire(chunk))
    assert view(target) == before
    target.finish_snapshot(chunks[-1].history)
    assert view(target) == view(source)
    assert target.get_topic("old") is None and target.read_log(w.lsn + 1, 10) == []
    meta = target.meta()
    assert (meta.log_start_lsn, meta.snapshot_pending, meta.cluster_id) == (
        w.lsn + 1,
        False,
        "cluster-a",
    )
    assert staged_records(target) == 0
    target = stores.reopen(target)
    assert view(target) == view(source)


def test_a_store_with_an_install_staged_serves_its_old_log(stores: Stores) -> None:
    """The live log stays in use while an install is staged: commits are recorded, the
    log compacts, and a snapshot of this store is its old state."""
    source, target = stores.make(), stores.make()
    fill(source)
    old = old_state(target)
    own = export(target)
    chunks = export(source, records_max=6)
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    target.install_chunk(wire(chunks[0]))
    assert [(c.snapshot_lsn, list(c.records)) for c in export(target)] == [
        (c.snapshot_lsn, list(c.records)) for c in own
    ]
    assert target.compact_log(3) == 2
    assert target.log_start_lsn() == 3
    assert target.meta().snapshot_pending
    for chunk in chunks[1:]:
        target.install_chunk(wire(chunk))
    target.finish_snapshot(chunks[-1].history)
    assert view(target) == view(source)
    assert target.log_start_lsn() == chunks[0].snapshot_lsn + 1 != old.lsn + 1


def test_an_append_drops_an_unfinished_install(stores: Stores) -> None:
    """Entries continue the live log (a new stream after an install cut short): the staged
    install is dropped in the same transaction; a refused batch drops nothing."""
    source, target = stores.make(), stores.make()
    fill(source)
    old = old_state(target)
    chunks = export(source, records_max=6)
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    target.install_chunk(wire(chunks[0]))
    target.install_chunk(wire(chunks[1]))
    target = stores.reopen(target)
    entries = old.entries(publish("old", 7, payloads(2)))
    with pytest.raises(InvalidEntryError):
        target.append(source.read_log(1, 1000), sync=False)  # not the live log's next LSN
    bad = replica_pb2.LogEntry()
    bad.CopyFrom(entries[0])
    bad.checksum ^= 1
    with pytest.raises(InvalidEntryError):
        target.append([bad], sync=False)
    assert target.meta().snapshot_pending  # the refused batches dropped nothing
    target.append(entries, sync=False)
    meta = target.meta()
    assert (meta.snapshot_pending, meta.last_lsn) == (False, old.lsn + 1)
    assert [e.offset for e in target.read_events("old", 0, 20)] == list(range(9))
    assert staged_records(target) == 0
    with pytest.raises(SnapshotError, match="no snapshot install"):
        target.install_chunk(wire(chunks[2]))
    # A new install over an unfinished one starts from nothing staged.
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    target.install_chunk(wire(chunks[0]))
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        target.install_chunk(wire(chunk))
    target.finish_snapshot(chunks[-1].history)
    assert view(target) == view(source)


def test_abort_snapshot_keeps_the_old_state(stores: Stores) -> None:
    source, target = stores.make(), stores.make()
    fill(source)
    old_state(target)
    before = view(target)
    assert not target.abort_snapshot()
    chunks = export(source, records_max=6)
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    target.install_chunk(wire(chunks[0]))
    assert target.abort_snapshot()
    assert not target.meta().snapshot_pending
    assert staged_records(target) == 0
    assert view(target) == before
    target = stores.reopen(target)
    assert view(target) == before
    with pytest.raises(SnapshotError, match="no snapshot install"):
        target.install_chunk(wire(chunks[1]))


def test_a_failed_finish_leaves_the_old_state_and_the_staged_install(stores: Stores) -> None:
    source, target = stores.make(), stores.make()
    fill(source)
    old_state(target)
    before = view(target)
    chunks = export(source, records_max=6)
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        target.install_chunk(wire(chunk))
    staged = staged_records(target)
    for history in ([], [(1, 1)], [(3, 1), (1, 9)]):
        with pytest.raises(SnapshotError):
            target.finish_snapshot(history)
        assert view(target) == before
        assert (target.meta().snapshot_pending, staged_records(target)) == (True, staged)
    target = stores.reopen(target)
    target.finish_snapshot(chunks[-1].history)
    assert view(target) == view(source)


def test_a_finish_that_runs_out_of_room_midway_changes_nothing() -> None:
    """The swap is one transaction: the store filling up while the staged records move
    in (the live state already cleared in it) rolls all of it back."""
    source = Store.open_memory()
    fill(source)
    chunks = export(source, records_max=6)

    def staged_store(capacity: int | None) -> Store:
        store = Store.open_memory(capacity)
        old_state(store)
        store.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
        for chunk in chunks:
            store.install_chunk(wire(chunk))
        return store

    probe = Store.open_memory()
    old_state(probe)
    live = probe.size_bytes()
    staged = staged_store(None).size_bytes() - live
    assert live < staged // 4
    # Room for the old state and the staged install, not for the staged records twice.
    target = staged_store(live + staged + staged // 2)
    before = view(target)
    with pytest.raises(StoreFullError):
        target.finish_snapshot(chunks[-1].history)
    assert view(target) == before
    assert target.meta().snapshot_pending
    roomy = staged_store(live + staged * 2 + 4096)
    roomy.finish_snapshot(chunks[-1].history)
    assert view(roomy) == view(source)


def _corrupt(chunk: Chunk, at: int, change: Callable[[replica_pb2.SnapshotRecord], None]) -> Chunk:
    bad = wire(chunk)
    change(bad.records[at])
    return bad


def _flip_value(record: replica_pb2.SnapshotRecord) -> None:
    record.value = record.value[:-1] + bytes([record.value[-1] ^ 0x01])


def test_corrupted_record_is_refused(stores: Stores) -> None:
    source, target = stores.make(), stores.make()
    fill(source)
    chunks = export(source, records_max=5)
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    target.install_chunk(wire(chunks[0]))
    events_at = next(i for i, c in enumerate(chunks) if i and c.records[-1].db == "events")
    bad_chunk = chunks[events_at]
    last = len(bad_chunk.records) - 1
    with pytest.raises(CorruptRecordError, match="checksum") as error:
        target.install_chunk(_corrupt(bad_chunk, last, _flip_value))
    assert (error.value.db, error.value.key) == (
        bad_chunk.records[last].db,
        bad_chunk.records[last].key,
    )

    moved = wire(bad_chunk)
    moved.records[last].value = moved.records[last - 1].value  # a valid value, wrong key
    with pytest.raises(CorruptRecordError, match="checksum"):
        target.install_chunk(moved)
    # Nothing of the refused chunks was written: the good chunks still install in order.
    for chunk in chunks[1:]:
        target.install_chunk(wire(chunk))
    target.finish_snapshot(chunks[-1].history)
    assert view(target) == view(source)


def test_chunks_out_of_order_or_foreign_are_refused(stores: Stores) -> None:
    source, target = stores.make(), stores.make()
    w = fill(source)
    chunks = export(source, records_max=5)
    with pytest.raises(SnapshotError, match="no snapshot install"):
        target.install_chunk(wire(chunks[0]))
    with pytest.raises(SnapshotError, match="no snapshot install"):
        target.finish_snapshot(chunks[-1].history)
    with pytest.raises(SnapshotError):
        target.begin_snapshot(5, 0)  # an LSN needs an epoch
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    with pytest.raises(SnapshotError, match="next chunk expected is 0"):
        target.install_chunk(wire(chunks[1]))
    other = wire(chunks[0])
    other.snapshot_lsn += 1
    with pytest.raises(SnapshotError, match="install in progress is at LSN"):
        target.install_chunk(other)
    target.install_chunk(wire(chunks[0]))
    with pytest.raises(SnapshotError, match="next chunk expected is 1"):
        target.install_chunk(wire(chunks[0]))  # a repeat

    refusals: dict[str, dict[str, Any]] = {
        "unknown database": {"db": "nope"},
        "the log": {"db": "log"},
        "node meta": {"db": "meta", "key": b"cluster_id"},
        "empty key": {"key": b""},
        "long key": {"key": b"\xff" * 600},
        "earlier key": {"key": b"\x00"},
    }
    for why, fields in refusals.items():
        bad = wire(chunks[1])
        for name, value in fields.items():
            setattr(bad.records[0], name, value)
        with pytest.raises(SnapshotError):
            target.install_chunk(bad)
        assert target.meta().snapshot_pending, why
    for chunk in chunks[1:-1]:
        target.install_chunk(wire(chunk))
    with pytest.raises(SnapshotError, match="not in"):
        target.finish_snapshot(chunks[-1].history)  # the last chunk is missing
    target.install_chunk(wire(chunks[-1]))
    with pytest.raises(SnapshotError, match="next chunk expected is none"):
        target.install_chunk(wire(chunks[-1]))
    for history in ([], [(1, 1)], [(1, 1), (3, w.lsn + 1)], [(3, 1), (1, 9)]):
        with pytest.raises(SnapshotError):
            target.finish_snapshot(history)
    assert target.meta().snapshot_pending
    target.finish_snapshot(chunks[-1].history)
    assert view(target) == view(source)


def test_memory_capacity_counts_what_an_install_clears() -> None:
    source = Store.open_memory()
    fill(source)
    target = Store.open_memory(capacity_bytes=50_000)
    w = Writer(target)
    w.append(epoch_start(1), create("t"), *(publish("t", i, [b"x" * 2000]) for i in range(10)))
    chunks = export(source)
    for _ in range(10):  # each install frees what the one before used
        install(target, chunks)
    assert view(target) == view(source)


def test_a_topics_incarnation_survives_snapshots_and_restarts(stores: Stores) -> None:
    """The index that ties dedupe state to a topic travels in the snapshot and survives a
    restart, so a destroy on the receiver (or after a restart) forgets the same state the
    sender forgets: the stores stay equal, and a re-created topic starts clean on both."""
    source, target = stores.make(), stores.make()
    w = fill(source)
    lsn = append_both((source,), w.lsn, [destroy("orders"), create("orders")], epoch=3)
    install(target, export(source))
    target = stores.reopen(target)
    source = stores.reopen(source)
    assert view(target) == view(source)
    # p and r wrote only to the destroyed orders: no state left; q keeps metrics'.
    assert [source.publisher_high_water(p) for p in PUBLISHERS] == [0, 40, 0]
    ops = [
        publish("orders", 0, payloads(3), publisher_id="p", sequences=[1, 2, 3]),
        destroy("metrics"),
    ]
    lsn = append_both((source, target), lsn, ops, epoch=3)
    assert view(target) == view(source)
    assert [target.publisher_high_water(p) for p in PUBLISHERS] == [3, 0, 0]
    state = [db for db in SNAPSHOT_DBS if db != "meta"]
    assert [target.counts()[db] for db in state] == [source.counts()[db] for db in state]
    assert [e.sequence for e in target.read_events("orders", 0, 10)] == [1, 2, 3]


def test_an_install_an_older_version_began_is_not_resumed(stores: Stores) -> None:
    """An older version emptied the live databases for an install and wrote its chunks
    there. Its pending record (no staged flag) is refused by the chunks and the finish;
    the replica's open of an LMDB store, or an abort, empties such a store as that
    version's abort did (it reported itself empty), and a new begin installs cleanly."""
    source, target = stores.make(), stores.make()
    fill(source)
    old_state(target)
    chunks = export(source, records_max=6)
    with target._kv.write(sync=False) as txn:  # what the older version's begin and chunk 0 did
        clear_state(txn)
        legacy = PendingInstall(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch, 1, False, 0, b"")
        for record in chunks[0].records:
            txn.put(record.db, record.key, record.value)
            legacy.last_db, legacy.last_key = SNAPSHOT_DBS.index(record.db) + 1, record.key
        legacy.staged = False
        txn.put("meta", b"snapshot_pending", legacy.encode())
    with pytest.raises(SnapshotError, match="older version"):
        target.install_chunk(wire(chunks[1]))
    with pytest.raises(SnapshotError, match="older version"):
        target.finish_snapshot(chunks[-1].history)
    if stores.kind == "lmdb":
        target = stores.reopen(target)  # the replica's open empties it
    else:
        assert target.abort_snapshot()  # so does an abort (a begin, an append)
    meta = target.meta()
    assert (meta.snapshot_pending, meta.last_lsn, meta.cluster_id) == (False, 0, "cluster-a")
    assert target.list_topics() == [] and staged_records(target) == 0
    install(target, chunks)
    assert view(target) == view(source)
