"""Truncation by rebuild: the store after truncating is the store as of that LSN."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.rebuild import LmdbTruncator, TruncateError, TruncationAbandoned
from squall_server.replica.store import Store, StoreError, make_entry

MAP_BYTES = 16 << 20


def _publish(lsn: int, epoch: int, offset: int, payload: bytes) -> replica_pb2.LogEntry:
    op = replica_pb2.Operation(
        publish=replica_pb2.PublishOp(
            topic="t", first_offset=offset, events=[common_pb2.EventData(payload=payload)]
        )
    )
    return make_entry(lsn, epoch, op)


def _filled(path: Path, events: int = 5) -> Store:
    store = Store.open_lmdb(path, MAP_BYTES)
    start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
    create = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name="t"))
    store.append(
        [make_entry(1, 1, start), make_entry(2, 1, create)]
        + [_publish(3 + i, 1, i, f"e{i}".encode()) for i in range(events)],
        sync=True,
    )
    store.set_cluster_id("c1")
    store.set_epoch(3)
    store.set_max_seen(3)
    store.set_state(common_pb2.STORE_STATE_DIRTY)
    return store


def test_truncating_rebuilds_the_state_of_the_kept_prefix(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
    staged = truncator.stage(store, 4)
    store = truncator.install(store, staged)
    try:
        meta = store.meta()
        assert (meta.last_lsn, meta.last_epoch, meta.epoch, meta.cluster_id) == (4, 1, 3, "c1")
        assert meta.state == common_pb2.STORE_STATE_DIRTY
        assert meta.max_seen == 3
        assert [e.payload for e in store.read_events("t", 0, 10)] == [b"e0", b"e1"]
        store.append([_publish(5, 2, 2, b"new")], sync=True)
        assert [e.payload for e in store.read_events("t", 0, 10)] == [b"e0", b"e1", b"new"]
        assert not staged.exists()
    finally:
        store.close()


def test_truncating_beyond_the_log_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    store = _filled(tmp_path)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
    try:
        with pytest.raises(TruncateError, match="the log ends at 7"):
            truncator.stage(store, 9)
        assert store.meta().last_lsn == 7
    finally:
        store.close()


def _given_up_after_one_batch() -> Callable[[], bool]:
    """An ``abandoned`` that lets the replay's first batch of entries through."""
    asked = [0]

    def abandoned() -> bool:
        asked[0] += 1
        return asked[0] > 1

    return abandoned


def _reads_from(store: Store) -> list[int]:
    """The first LSN of every log read of store from now on."""
    firsts: list[int] = []
    read_log = store.read_log

    def recording(first_lsn: int, count: int) -> list[replica_pb2.LogEntry]:
        firsts.append(first_lsn)
        return read_log(first_lsn, count)

    store.read_log = recording  # type: ignore[method-assign]
    return firsts


def test_a_replay_given_up_resumes_where_it_stopped_and_rebuilds_the_same_state(
    tmp_path: Path,
) -> None:
    """Chaos seed 86: a slave's replay given up at a re-formation was redone from LSN 1
    when it became the next master (10,240 entries replayed twice, seconds with no
    master). The copy is kept: the next truncation replays only what it lacked."""
    store = _filled(tmp_path, events=2500)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
    with pytest.raises(TruncationAbandoned, match="1024 entries replayed"):
        truncator.stage(store, 2000, _given_up_after_one_batch())
    assert store.meta().last_lsn == 2502
    assert truncator.resumes_from(store, 2000) == 1024
    reads = _reads_from(store)
    store = truncator.install(store, truncator.stage(store, 2000))
    try:
        assert reads == [1025]  # 976 entries: 1025..2000
        assert truncator.resumes_from(store, 2000) == 0
        meta = store.meta()
        assert (meta.last_lsn, meta.epoch, meta.cluster_id, meta.max_seen) == (2000, 3, "c1", 3)
        expected = [f"e{i}".encode() for i in range(1998)]
        assert [e.payload for e in store.read_events("t", 0, 3000)] == expected
        store.append([_publish(2001, 2, 1998, b"new")], sync=True)
        assert store.read_events("t", 1998, 10)[0].payload == b"new"
        assert not (tmp_path / "truncate.staging").exists()
    finally:
        store.close()


def test_a_given_up_replay_is_not_resumed_past_the_kept_lsn_or_for_another_store(
    tmp_path: Path,
) -> None:
    store = _filled(tmp_path, events=2500)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
    with pytest.raises(TruncationAbandoned):
        truncator.stage(store, 2000, _given_up_after_one_batch())
    # The copy holds 1024 entries: a truncation after LSN 500 replays from LSN 1.
    assert truncator.resumes_from(store, 500) == 0
    assert truncator.resumes_from(store, 1024) == 1024
    reads = _reads_from(store)
    staged = truncator.stage(store, 500)
    assert reads == [1]
    store = truncator.install(store, staged)
    assert [e.payload for e in store.read_events("t", 0, 3000)][-1] == b"e497"
    store.append([_publish(501 + i, 2, 498 + i, b"x") for i in range(1600)], sync=True)
    with pytest.raises(TruncationAbandoned):
        truncator.stage(store, 2000, _given_up_after_one_batch())
    store.close()
    store = Store.open_lmdb(tmp_path, MAP_BYTES)  # the same file, another store: no resume
    try:
        assert truncator.resumes_from(store, 1800) == 0
        reads = _reads_from(store)
        store = truncator.install(store, truncator.stage(store, 1800))
        assert reads == [1, 1025]
        assert store.meta().last_lsn == 1800
    finally:
        store.close()


def test_discarding_drops_a_given_up_replay(tmp_path: Path) -> None:
    store = _filled(tmp_path, events=2500)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
    try:
        with pytest.raises(TruncationAbandoned):
            truncator.stage(store, 2000, _given_up_after_one_batch())
        assert (tmp_path / "truncate.staging").exists()
        truncator.discard()
        assert truncator.resumes_from(store, 2000) == 0
        assert not (tmp_path / "truncate.staging").exists()
    finally:
        store.close()


def test_a_given_up_replay_is_not_resumed_once_a_snapshot_replaced_the_log(
    tmp_path: Path,
) -> None:
    """A snapshot's install changes the log below its end in the same store object: the
    copy's prefix is no longer the store's, so it must not be resumed."""
    store = _filled(tmp_path, events=2500)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
    with pytest.raises(TruncationAbandoned):
        truncator.stage(store, 2000, _given_up_after_one_batch())
    source = Store.open_memory()
    start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=5, master_id="n3"))
    create = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name="t"))
    source.append(
        [make_entry(1, 5, start), make_entry(2, 5, create)]
        + [_publish(3 + i, 5, i, b"other") for i in range(598)],
        sync=True,
    )
    with closing(source.snapshot_chunks()) as chunks:
        exported = list(chunks)
    store.begin_snapshot(exported[0].snapshot_lsn, exported[0].snapshot_epoch)
    for chunk in exported:
        store.install_chunk(chunk)
    store.finish_snapshot(exported[-1].history)
    store.append([_publish(601 + i, 5, 598 + i, b"other") for i in range(1500)], sync=True)
    try:
        assert truncator.resumes_from(store, 2000) == 0
        # (A replica routes a truncation below its log's start to a snapshot instead.)
        with pytest.raises(StoreError, match="LSN 1 was compacted: the log starts at LSN 601"):
            truncator.stage(store, 2000)
        assert store.meta().last_lsn == 2100
    finally:
        store.close()
