"""The in-memory store twin under a machine crash (``MemoryKV.lose_unsynced``).

A process crash loses nothing committed; a machine crash loses what was committed since
the last flush, all of it and nothing else, as LMDB comes back to its last synced state.
The simulator relies on this to test what the replica sync policies promise.
"""

from __future__ import annotations

from squall_server.replica.store import Store
from squall_server.replica.store.kv_memory import MemoryKV
from tests.unit.test_store_contract import Writer, create, epoch_start, observe, payloads, publish


def _crashable() -> tuple[Store, MemoryKV]:
    store = Store.open_memory(keep_unsynced=True)
    kv = store._kv
    assert isinstance(kv, MemoryKV)
    return store, kv


def test_a_machine_crash_loses_exactly_what_was_committed_since_the_last_flush() -> None:
    store, kv = _crashable()
    store.append(Writer(store).entries(epoch_start(1), create("t")), sync=True)
    store.append(Writer(store).entries(publish("t", 0, payloads(2))), sync=True, commit_lsn=2)
    flushed, flushed_bytes = observe(store), kv.size_bytes()

    store.append(Writer(store).entries(publish("t", 2, payloads(3))), sync=False, commit_lsn=3)
    store.append(Writer(store).entries(create("u")), sync=False)
    assert Store(kv).meta().last_lsn == 5  # a process crash: everything committed is there

    assert kv.lose_unsynced() == 2
    after = Store(kv)  # the restarted process reopens the store
    assert observe(after) == flushed
    assert after.meta().last_lsn == 3 and after.meta().commit_lsn == 2
    assert [e.lsn for e in after.read_log(1, 10)] == [1, 2, 3]
    assert kv.size_bytes() == flushed_bytes  # a full map is judged on what survived

    # The log goes on from the flushed state, and a flush makes later writes survive.
    after.append(Writer(after).entries(publish("t", 2, payloads(1))), sync=False)
    after.sync()
    assert kv.lose_unsynced() == 0
    assert Store(kv).meta().last_lsn == 4


def test_a_flushed_write_flushes_every_earlier_one_and_the_log_is_off_by_default() -> None:
    store, kv = _crashable()
    store.append(Writer(store).entries(epoch_start(1)), sync=False)
    store.append(Writer(store).entries(create("t")), sync=True)  # flushes LSN 1 as well
    assert kv.lose_unsynced() == 0 and Store(kv).meta().last_lsn == 2

    plain = Store.open_memory()
    plain.append(Writer(plain).entries(epoch_start(1)), sync=False)
    plain_kv = plain._kv
    assert isinstance(plain_kv, MemoryKV)
    assert plain_kv.lose_unsynced() == 0 and plain.meta().last_lsn == 1
