"""The store's per-topic byte count (``TopicInfo.size_bytes``), on both twins.

Every check compares the count the topic record carries with a recount of the event
records the store actually holds for the topic, after each write path that adds or
removes events: publish, destroy and re-create, a snapshot install, a truncation
(a rebuild from the log), log compaction (which drops no events); and a record written
before the count existed reports the size as unknown.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

import squall
from squall.v1 import common_pb2
from squall_server.replica.rebuild import rebuild_into
from squall_server.replica.server import topic_message
from squall_server.replica.store import DB_EVENTS, DB_TOPICS, InvalidEntryError, Store
from squall_server.replica.store.records import TOPIC_RECORD, U64, seal, unseal
from tests.unit.test_store_contract import (
    StoreFactory,
    Writer,
    create,
    destroy,
    epoch_start,
    payloads,
    publish,
    topic,
)
from tests.unit.test_store_snapshot import fill, install, more_ops


@pytest.fixture(params=["memory", "lmdb"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    """Opens stores of the parametrized twin; closes them at the end."""
    stores: list[Store] = []

    def make() -> Store:
        if request.param == "memory":
            made = Store.open_memory()
        else:
            made = Store.open_lmdb(tmp_path / f"store-{len(stores)}", 64 << 20)
        stores.append(made)
        return made

    yield make
    for made in stores:
        made.close()


@pytest.fixture
def store(make_store: StoreFactory) -> Store:
    """An empty store of the parametrized twin."""
    return make_store()


def recount(store: Store, name: str) -> int:
    """The bytes of the event records the store holds for the topic, counted one by one."""
    topic_id = topic(store, name).topic_id
    lo, hi = U64.pack(topic_id), U64.pack(topic_id + 1)
    with store._kv.read() as txn:  # the recount reads the raw records
        return sum(len(value) for _, value in txn.scan(DB_EVENTS, lo, hi))


def assert_counts_match(store: Store) -> dict[str, int | None]:
    """Every topic's count equals its recount; returns the counts by name."""
    sizes = {}
    for info in store.list_topics():
        assert info.size_bytes == recount(store, info.name), info.name
        assert store.get_topic(info.name) == info
        sizes[info.name] = info.size_bytes
    return sizes


def test_publish_counts_the_stored_records(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("a"), create("b"))
    assert assert_counts_match(store) == {"a": 0, "b": 0}
    keyed = publish("a", 0, payloads(2), publisher_id="p", sequences=[1, 2])
    keyed.publish.events[0].key = b"some-key"
    keyed.publish.events[0].headers["h"] = "v" * 100
    w.append(keyed, publish("b", 0, payloads(3)), publish("a", 2, [b"x" * 1000]))
    sizes = assert_counts_match(store)
    # Payload, key and headers are in it: the 1000-byte event and the long header count.
    assert sizes["a"] is not None and sizes["a"] > 1000 + 100 + len(b"some-key")
    before = sizes["a"]
    w.append(publish("a", 3, [b"y" * 10]))
    after = assert_counts_match(store)["a"]
    assert after is not None and after > before + 10


def test_a_refused_batch_leaves_the_count(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("a"), publish("a", 0, payloads(4)))
    before = topic(store, "a").size_bytes
    with pytest.raises(InvalidEntryError):
        # The publish is applied, then the batch fails on the offset gap: nothing stays.
        entries = w.entries(publish("a", 4, payloads(2)), publish("a", 9, payloads(1)))
        store.append(entries, sync=False)
    assert topic(store, "a").size_bytes == before == recount(store, "a")


def test_destroy_and_recreate_start_the_count_again(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), create("keep"))
    w.append(publish("t", 0, payloads(5)), publish("keep", 0, payloads(2)))
    keep = assert_counts_match(store)["keep"]
    w.append(destroy("t"), create("t"))
    assert assert_counts_match(store) == {"keep": keep, "t": 0}
    w.append(publish("t", 0, [b"z"]), destroy("keep"), create("keep"))
    sizes = assert_counts_match(store)
    assert sizes["keep"] == 0 and (sizes["t"] or 0) > 0


def test_snapshot_install_carries_the_counts(make_store: StoreFactory) -> None:
    source, target = make_store(), make_store()
    w = fill(source)
    w.append(publish("orders", topic(source, "orders").next_offset, [b"extra" * 50]))
    expected = assert_counts_match(source)
    Writer(target).append(epoch_start(1), create("orders"), publish("orders", 0, payloads(9)))
    with closing(source.snapshot_chunks(records_max=7)) as chunks:
        install(target, list(chunks))
    assert assert_counts_match(target) == expected
    # Appends after the install go on counting from the installed count.
    last = target.meta().last_lsn
    Writer(target, epoch=3).append(*more_ops(target))
    assert target.meta().last_lsn > last
    sizes = assert_counts_match(target)
    assert sizes["metrics"] == recount(target, "metrics") and sizes["fresh"]


def test_truncation_rebuild_counts_only_what_is_kept(make_store: StoreFactory) -> None:
    store, fresh = make_store(), make_store()
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(3)))
    keep_lsn = w.lsn
    kept = topic(store, "t").size_bytes
    w.append(publish("t", 3, payloads(4)))  # the suffix the truncation removes
    assert (topic(store, "t").size_bytes or 0) > (kept or 0)
    rebuild_into(store, fresh, keep_lsn)
    assert assert_counts_match(fresh) == {"t": kept}


def test_compaction_drops_no_events_and_keeps_the_count(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("t"), publish("t", 0, payloads(3)))
    w.append(publish("t", 3, payloads(3)))
    before = assert_counts_match(store)
    store.compact_log(w.lsn)
    assert assert_counts_match(store) == before


def _make_old_record(store: Store, name: str) -> None:
    """Rewrites the topic's record as a store from before the count wrote it."""
    key = name.encode()
    with store._kv.write(sync=False) as txn:  # building an old store
        body = unseal(DB_TOPICS, key, txn.get(DB_TOPICS, key) or b"")
        txn.put(DB_TOPICS, key, seal(key, body[: TOPIC_RECORD.size]))


def test_a_record_from_before_the_count_reports_unknown(store: Store) -> None:
    w = Writer(store)
    w.append(epoch_start(1), create("old"), publish("old", 0, payloads(3)))
    _make_old_record(store, "old")
    info = topic(store, "old")
    assert info.size_bytes is None and info.next_offset == 3
    w.append(publish("old", 3, payloads(1)))  # unknown stays unknown, never a wrong number
    assert topic(store, "old").size_bytes is None
    assert topic(store, "old").next_offset == 4
    w.append(destroy("old"), create("old"))
    assert topic(store, "old").size_bytes == 0


def test_topic_message_and_client_info_say_when_the_size_is_known(store: Store) -> None:
    w = Writer(store)
    w.append(
        epoch_start(1),
        create("r"),
        create("tr", kind=common_pb2.TOPIC_KIND_TRANSIENT),
        create("old"),
        publish("r", 0, payloads(2)),
    )
    _make_old_record(store, "old")
    wire = {name: topic_message(topic(store, name)) for name in ("r", "tr", "old")}
    assert wire["r"].size_known and wire["r"].size_bytes == recount(store, "r") > 0
    assert not wire["tr"].size_known and not wire["old"].size_known
    infos = {n: squall.TopicInfo.from_pb(m) for n, m in wire.items()}
    assert infos["r"].size_bytes == recount(store, "r")
    assert infos["tr"].size_bytes is None and infos["old"].size_bytes is None
    # An older server sends no size: unknown, not 0.
    assert squall.TopicInfo.from_pb(common_pb2.Topic(name="x")).size_bytes is None
