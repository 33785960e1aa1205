"""The store's record of the commit LSN, and of a snapshot's uncommitted publishes.

A replica that restarts must not serve entries it never knew committed (a deposed
master's suffix, a slave's last batch): the store records the commit LSN the node knew,
cheaply, in the transactions it already makes, and an installed snapshot records what it
held above its sender's commit LSN. Run against both store twins; LMDB also reopened.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from squall.v1 import replica_pb2
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.store import SnapshotError, Store
from tests.unit.test_store_contract import Writer, create, epoch_start, observe, payloads, publish
from tests.unit.test_store_snapshot import Stores, export, wire


@pytest.fixture(params=["memory", "lmdb"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    made = Stores(request.param, tmp_path)
    yield made
    for store in made.open:
        store.close()


def _five(store: Store, commit_lsn: int | None) -> None:
    """LSNs 1..5: an epoch start, a topic, three publishes; recorded commit as given."""
    w = Writer(store)
    entries = w.entries(
        epoch_start(1),
        create("t"),
        publish("t", 0, payloads(2)),
        publish("t", 2, payloads(1)),
        publish("t", 3, payloads(4)),
    )
    store.append(entries, sync=False, commit_lsn=commit_lsn)


def test_a_store_that_never_recorded_a_commit_lsn_says_so(stores: Stores) -> None:
    store = stores.make()
    _five(store, None)
    assert store.meta().commit_lsn is None


def test_append_records_the_commit_lsn_it_is_given_up_to_its_last_lsn(stores: Stores) -> None:
    store = stores.make()
    _five(store, 3)
    store = stores.reopen(store)
    assert store.meta().commit_lsn == 3
    w = Writer(store)
    # A master's commit LSN may run ahead of what this store holds: held is what counts.
    store.append(w.entries(publish("t", 7, payloads(1))), sync=True, commit_lsn=99)
    assert store.meta().commit_lsn == 6
    # It never goes back: a commit learnt is a fact.
    store.append(Writer(store).entries(publish("t", 8, payloads(1))), sync=True, commit_lsn=2)
    assert stores.reopen(store).meta().commit_lsn == 6


def test_record_commit_raises_it_without_an_append(stores: Stores) -> None:
    store = stores.make()
    _five(store, 1)
    assert store.record_commit(4) == 4
    assert store.record_commit(2) == 4  # never lower
    assert store.record_commit(50) == 5  # at most the last LSN
    store = stores.reopen(store)
    assert store.meta().commit_lsn == 5
    with pytest.raises(ValueError, match="not a uint64"):
        store.record_commit(-1)


def test_set_commit_lsn_may_lower_it_for_a_rebuilt_store(stores: Stores) -> None:
    store = stores.make()
    _five(store, 5)
    store.set_commit_lsn(2)
    assert store.meta().commit_lsn == 2


def test_a_truncation_keeps_the_commit_lsn_within_the_kept_log(tmp_path: Path) -> None:
    store = Store.open_lmdb(tmp_path, 16 << 20)
    _five(store, 4)
    truncator = LmdbTruncator(tmp_path, map_size_bytes=16 << 20, dedupe_window=1000)
    store = truncator.install(store, truncator.stage(store, 4))
    try:
        assert (store.meta().last_lsn, store.meta().commit_lsn) == (4, 4)
    finally:
        store.close()
    store = Store.open_lmdb(tmp_path, 16 << 20)
    try:
        Writer(store).append(publish("t", 3, payloads(1)), publish("t", 4, payloads(1)))
        store.set_commit_lsn(6)
        store = truncator.install(store, truncator.stage(store, 5))
        assert store.meta().commit_lsn == 5
    finally:
        store.close()


def _snapshot_of(stores: Stores) -> list[replica_pb2.SnapshotChunk]:
    source = stores.make()
    _five(source, 2)
    return [wire(c) for c in export(source)]


def _install(target: Store, chunks: list[replica_pb2.SnapshotChunk]) -> None:
    target.begin_snapshot(chunks[0].snapshot_lsn, chunks[0].snapshot_epoch)
    for chunk in chunks:
        target.install_chunk(chunk)


def test_an_installed_snapshot_records_its_commit_lsn_and_uncommitted_publishes(
    stores: Stores,
) -> None:
    chunks = _snapshot_of(stores)
    target = stores.make()
    _five(target, 5)
    _install(target, chunks)
    # The install is staged: the live log and its commit record stay until it finishes.
    assert target.meta().commit_lsn == 5
    # Listed in any order, recorded by last LSN.
    target.finish_snapshot([(1, 1)], commit_lsn=2, uncommitted=[("u", 0, 5), ("t", 0, 3)])
    target = stores.reopen(target)
    assert target.meta().commit_lsn == 2
    assert target.snapshot_uncommitted() == [("t", 0, 3), ("u", 0, 5)]
    # A new install forgets the old list once it finishes (the old state is served until).
    _install(target, chunks)
    assert target.snapshot_uncommitted() == [("t", 0, 3), ("u", 0, 5)]
    target.finish_snapshot([(1, 1)], commit_lsn=9)
    assert (target.meta().commit_lsn, target.snapshot_uncommitted()) == (5, [])


@pytest.mark.parametrize(
    ("uncommitted", "problem"),
    [
        ([("t", 0, 2)], "at LSN 2, outside 3..5"),
        ([("t", 0, 6)], "at LSN 6, outside 3..5"),
        ([("", 0, 4)], "topic name of 0 bytes"),
        ([("t", 0, 4), ("t", 1, 5)], "listed twice"),
    ],
)
def test_a_bad_uncommitted_list_is_refused_and_changes_nothing(
    stores: Stores, uncommitted: list[tuple[str, int, int]], problem: str
) -> None:
    chunks = _snapshot_of(stores)
    target = stores.make()
    _install(target, chunks)
    before = observe(target)
    with pytest.raises(SnapshotError, match=problem):
        target.finish_snapshot([(1, 1)], commit_lsn=2, uncommitted=uncommitted)
    assert observe(target) == before
    target.finish_snapshot([(1, 1)], commit_lsn=2, uncommitted=[("t", 0, 5)])
    assert target.snapshot_uncommitted() == [("t", 0, 5)]
