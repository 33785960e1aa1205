"""LMDB-only store behaviour: reopening, a full map, and damaged records on disk.

Damage is made the realistic ways: bytes flipped in the closed data file, and bad values
written through a raw lmdb handle to the same environment. Either way the store must
report CorruptRecordError naming the database and key, and never return the bad data.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import lmdb
import pytest

from squall.v1 import common_pb2
from squall_server.replica import fault_hooks
from squall_server.replica.store import (
    DATABASES,
    CorruptRecordError,
    LogCompactedError,
    Store,
    StoreError,
    StoreFullError,
    kv_lmdb,
)
from squall_server.replica.store.kv_lmdb import LmdbKV
from squall_server.replica.store.records import LIVE_DATABASES
from tests.unit.test_store_contract import (
    Writer,
    create,
    epoch_start,
    observe,
    payloads,
    publish,
    set_cursor,
)

MAP_SIZE_BYTES = 64 << 20


def fill(store: Store) -> Writer:
    """A store with meta, two topics, events, a cursor and dedupe records."""
    store.set_cluster_id("cluster-a")
    store.set_state(common_pb2.STORE_STATE_DIRTY)
    store.set_epoch(2)
    store.set_max_seen(3)
    w = Writer(store, epoch=2)
    w.append(epoch_start(2), create("t"), create("u"))
    w.append(publish("t", 0, payloads(3), publisher_id="p", sequences=[1, 2, 3]))
    w.append(publish("u", 0, [b"MARKER-payload-one-of-a-kind"]), set_cursor("t", "s", 2))
    return w


def test_reopen_keeps_everything(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    w = fill(store)
    before = observe(store, ("p",))
    store.close()
    store.close()  # closing twice is harmless
    with pytest.raises(StoreError):
        store.meta()

    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    assert observe(store, ("p",)) == before
    assert store.meta().cluster_id == "cluster-a"
    # The log continues where it stopped.
    store.append(w.entries(publish("t", 3, payloads(1))), sync=True)
    assert store.meta().last_lsn == before[0].last_lsn + 1
    assert [e.offset for e in store.read_events("t", 0, 10)] == [0, 1, 2, 3]
    store.close()


def test_compaction_survives_reopen(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    w = fill(store)
    w.append(*(publish("t", 3 + i, payloads(1, 3 + i)) for i in range(2500)))
    assert store.compact_log(2000, batch_entries=300) == 1999  # 7 write transactions
    before = observe_from(store, 2000)
    store.close()
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    assert store.log_start_lsn() == 2000
    assert observe_from(store, 2000) == before
    with pytest.raises(LogCompactedError):
        store.read_log(1999, 1)
    store.append(w.entries(publish("t", 2503, payloads(1))), sync=True)
    assert store.read_log(w.lsn + 1, 10)[0].lsn == w.lsn + 1
    store.close()


def observe_from(store: Store, log_start_lsn: int) -> tuple[object, ...]:
    """What a reader sees, with the log read from its start."""
    meta = store.meta()
    events = store.read_events("t", 0, 10_000)
    return meta, events, store.read_log(log_start_lsn, 10_000)


def test_open_refuses_a_bad_path(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(StoreError):
        Store.open_lmdb(not_a_dir / "store", MAP_SIZE_BYTES)


def test_map_full_aborts_the_batch_and_keeps_the_store(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, 1 << 20)  # 1 MiB
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(50)))
    before = observe(store)
    big = [publish("t", 50 + i * 100, [b"x" * 1000] * 100) for i in range(20)]  # ~2 MB
    with pytest.raises(StoreFullError):
        store.append(w.entries(*big), sync=True)
    assert observe(store) == before  # nothing of the failed batch is visible
    w.append(publish("t", 50, payloads(5, start=50)))  # a smaller write still works
    assert len(store.read_events("t", 0, 1000)) == 55
    store.close()
    store = Store.open_lmdb(tmp_path, 1 << 20)
    assert len(store.read_events("t", 0, 1000)) == 55
    store.close()


class _Room:
    """What os.statvfs says of a filesystem with `available` bytes left of 1 GiB."""

    def __init__(self, available: int) -> None:
        self.f_frsize = 4096
        self.f_bavail = available // 4096
        self.f_blocks = (1 << 30) // 4096


@pytest.mark.parametrize(
    ("said", "available", "full"),
    [
        ("mdb_txn_commit: No space left on device", 1 << 29, True),
        ("mdb_txn_commit: Disk quota exceeded", 1 << 29, True),
        # LMDB's word for a short write, which a nearly full filesystem gives.
        ("mdb_txn_commit: Input/output error", 8192, True),
        # With room to spare it is a failing disk, said as LMDB says it.
        ("mdb_txn_commit: Input/output error", 1 << 29, False),
        ("mdb_txn_commit: Permission denied", 0, False),
    ],
)
def test_a_commit_that_found_no_room_says_the_filesystem_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: str, available: int, full: bool
) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    w = Writer(store)
    w.append(epoch_start(1), create("t"))
    before = observe(store)

    def refuse(txn: object) -> None:
        raise lmdb.Error(said)

    monkeypatch.setattr(fault_hooks, "before_commit", refuse)
    monkeypatch.setattr(kv_lmdb.os, "statvfs", lambda path: _Room(available))
    with pytest.raises(StoreError) as failed:
        w.append(publish("t", 0, payloads(1)))
    message = str(failed.value)
    assert said in message
    named = f"the filesystem holding {tmp_path} is full ({available} of {1 << 30} bytes"
    assert (named in message and "the store is sound" in message) is full, message
    assert not isinstance(failed.value, StoreFullError)  # a fail-stop, failing over
    monkeypatch.undo()
    assert observe(store) == before  # the aborted commit left the store as it was
    store.close()


def test_byte_flipped_in_data_file(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    fill(store)
    u_lsn = store.read_events("u", 0, 1)[0].lsn
    store.close()

    data_file = tmp_path / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    marker = b"MARKER-payload"
    hits = 0
    at = raw.find(marker)
    while at >= 0:  # the log entry and the event record both hold the payload
        raw[at] ^= 0x01
        hits += 1
        at = raw.find(marker, at + 1)
    assert hits >= 2
    data_file.write_bytes(bytes(raw))

    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with pytest.raises(CorruptRecordError) as event_error:
        store.read_events("u", 0, 10)
    assert event_error.value.db == "events"
    with pytest.raises(CorruptRecordError) as log_error:
        store.read_log(u_lsn, 1)
    assert log_error.value.db == "log"
    # Records on the same pages that were not damaged are still served.
    assert [e.offset for e in store.read_events("t", 0, 10)] == [0, 1, 2]
    assert len(store.read_log(1, u_lsn - 1)) == u_lsn - 1
    store.close()


def _damage(tmp_path: Path, db: str, key: bytes, change: Callable[[bytes], bytes]) -> None:
    """Rewrites one value through a raw handle to the store's environment."""
    env = lmdb.open(str(tmp_path), max_dbs=len(DATABASES), map_size=MAP_SIZE_BYTES)
    try:
        handle = env.open_db(db.encode(), create=False)
        with env.begin(write=True, db=handle) as txn:
            value = txn.get(key)
            assert value is not None, f"no {key!r} in {db}"
            txn.put(key, change(value))
    finally:
        env.close()


def _flip_last_byte(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0x40])


_PREFIX_P = len(b"p").to_bytes(2, "big") + b"p"
_TOPIC_T_ID = (1).to_bytes(8, "big")

# (db, key, a read that must refuse the damaged record)
_RECORDS: list[tuple[str, bytes, Callable[[Store], object]]] = [
    ("meta", b"log_tail", lambda s: s.meta()),
    ("meta", b"history", lambda s: s.meta()),
    ("meta", b"cluster_id", lambda s: s.meta()),
    ("log", (2).to_bytes(8, "big"), lambda s: s.read_log(1, 10)),
    ("topics", b"t", lambda s: s.get_topic("t")),
    ("topics", b"u", lambda s: s.list_topics()),
    ("events", _TOPIC_T_ID + (1).to_bytes(8, "big"), lambda s: s.read_events("t", 0, 10)),
    ("cursors", _TOPIC_T_ID + b"s", lambda s: s.get_cursor("t", "s")),
    ("cursors", _TOPIC_T_ID + b"s", lambda s: s.list_subscriptions("t")),
    ("dedupe", _PREFIX_P + (3).to_bytes(8, "big"), lambda s: s.lookup_sequence("p", 2)),
    ("publishers", b"p", lambda s: s.publisher_high_water("p")),
]


@pytest.mark.parametrize(("db", "key", "read"), _RECORDS, ids=lambda v: str(v)[:20])
def test_corrupted_record_is_reported_not_served(
    tmp_path: Path, db: str, key: bytes, read: Callable[[Store], object]
) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    fill(store)
    store.close()
    _damage(tmp_path, db, key, _flip_last_byte)

    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with pytest.raises(CorruptRecordError) as error:
        read(store)
    assert (error.value.db, error.value.key) == (db, key)
    assert key.hex() in str(error.value)
    store.close()


def test_corrupted_meta_stops_appends(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    w = fill(store)
    store.close()
    _damage(tmp_path, "meta", b"log_tail", _flip_last_byte)
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with pytest.raises(CorruptRecordError):
        store.append(w.entries(publish("t", 3, payloads(1))), sync=False)
    store.close()


def test_value_moved_to_another_key_is_refused(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    fill(store)
    store.close()
    first = _TOPIC_T_ID + (0).to_bytes(8, "big")
    second = _TOPIC_T_ID + (1).to_bytes(8, "big")
    env = lmdb.open(str(tmp_path), max_dbs=len(DATABASES), map_size=MAP_SIZE_BYTES)
    with env.begin(write=True, db=env.open_db(b"events", create=False)) as txn:
        value = txn.get(first)
        assert value is not None
        txn.put(second, value)  # a valid record, under the wrong key
    env.close()
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with pytest.raises(CorruptRecordError) as error:
        store.read_events("t", 0, 10)
    assert error.value.key == second
    assert [e.offset for e in store.read_events("t", 0, 1)] == [0]
    store.close()


def test_missing_event_is_reported(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    fill(store)
    store.close()
    env = lmdb.open(str(tmp_path), max_dbs=len(DATABASES), map_size=MAP_SIZE_BYTES)
    with env.begin(write=True, db=env.open_db(b"events", create=False)) as txn:
        assert txn.delete(_TOPIC_T_ID + (1).to_bytes(8, "big"))
    env.close()
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with pytest.raises(CorruptRecordError, match="missing"):
        store.read_events("t", 0, 10)
    with pytest.raises(CorruptRecordError, match="missing"):
        store.read_events("t", 1, 1)
    store.close()


def test_export_refuses_a_damaged_record(tmp_path: Path) -> None:
    """A master never sends a record that fails its checksum: the export stops there."""
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    fill(store)
    store.close()
    key = _TOPIC_T_ID + (1).to_bytes(8, "big")
    _damage(tmp_path, "events", key, _flip_last_byte)
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with pytest.raises(CorruptRecordError) as error, closing(store.snapshot_chunks()) as chunks:
        list(chunks)
    assert (error.value.db, error.value.key) == ("events", key)
    store.close()


def test_a_store_written_before_the_staging_databases_opens(tmp_path: Path) -> None:
    """A store last written by a version without the snapshot staging databases: a
    read-only open (the offline tools, which create nothing) reads it as it is, and the
    replica's own open adds them."""
    old = Store(LmdbKV(tmp_path, LIVE_DATABASES, map_size_bytes=MAP_SIZE_BYTES))
    w = fill(old)
    seen = observe(old, ("p",))
    old.close()
    reader = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES, readonly=True, lock=False)
    assert observe(reader, ("p",)) == seen
    assert reader.meta().last_lsn == w.lsn and not reader.meta().snapshot_pending
    reader.close()
    store = Store.open_lmdb(tmp_path, MAP_SIZE_BYTES)
    with closing(store.snapshot_chunks()) as exported:
        chunks = list(exported)
    store.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        store.install_chunk(chunk)
    topics = store.list_topics()
    store.finish_snapshot(chunks[-1].history)
    assert store.list_topics() == topics
    assert [e.offset for e in store.read_events("t", 0, 10)] == [0, 1, 2]
    assert (store.meta().last_lsn, store.log_start_lsn()) == (w.lsn, w.lsn + 1)
    store.close()
