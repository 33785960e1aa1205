"""Truncation by rebuild: the store after truncating is the store as of that LSN."""

from __future__ import annotations

from pathlib import Path

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.rebuild import LmdbTruncator, TruncateError
from squall_server.replica.store import Store, make_entry

MAP_BYTES = 16 << 20


def _publish(lsn: int, epoch: int, offset: int, payload: bytes) -> replica_pb2.LogEntry:
    op = replica_pb2.Operation(
        publish=replica_pb2.PublishOp(
            topic="t", first_offset=offset, events=[common_pb2.EventData(payload=payload)]
        )
    )
    return make_entry(lsn, epoch, op)


def _filled(path: Path) -> Store:
    store = Store.open_lmdb(path, MAP_BYTES)
    start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
    create = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name="t"))
    store.append(
        [make_entry(1, 1, start), make_entry(2, 1, create)]
        + [_publish(3 + i, 1, i, f"e{i}".encode()) for i in range(5)],
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
