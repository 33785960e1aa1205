"""The store's record decoding under corruption (issue 9, item 4).

A store is filled through its log (topics, events with publisher sequences, a cursor, a
push subscriber), then ONE stored record is damaged underneath it, in the KV itself:
bit flips, truncation, extension, or random bytes. Every read the store offers is made
again. Properties:

* Damaged on disk (the checksum no longer matches): every read either answers exactly
  what it answered before, or raises CorruptRecordError naming the damaged database; at
  least one read raises (every record is read by something). Never another exception,
  never a different answer.
* Damaged behind a valid checksum (what a hostile peer's snapshot chunk can carry, since
  the sender seals it): reads may answer differently, but only ever fail with a
  StoreError, never with a decoding crash (struct, Unicode, protobuf, index errors).
* On a replica, a damaged event is answered DATA_LOSS and quarantines the node (the
  fault is recorded beside the store, for the coordinator), rather than served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.config import parse_config
from squall_server.common.errors import Code, ServiceError
from squall_server.replica import server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.faults import load_fault
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import (
    DATABASES,
    CorruptRecordError,
    Store,
    StoreError,
    make_entry,
)
from squall_server.replica.store.records import seal

_op = replica_pb2.Operation
_EVENTS = [
    common_pb2.EventData(key=b"k%d" % i, payload=b"payload %d" % i, sequence=i + 1)
    for i in range(6)
]


def _entries() -> list[replica_pb2.LogEntry]:
    ops = [
        _op(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1")),
        _op(create_topic=replica_pb2.CreateTopicOp(name="alpha")),
        _op(create_topic=replica_pb2.CreateTopicOp(name="beta")),
        _op(
            publish=replica_pb2.PublishOp(
                topic="alpha", first_offset=0, publisher_id="p1", events=_EVENTS[:3], timestamp_ms=1
            )
        ),
        _op(
            publish=replica_pb2.PublishOp(
                topic="beta", first_offset=0, publisher_id="p2", events=_EVENTS[3:], timestamp_ms=2
            )
        ),
        _op(set_cursor=replica_pb2.SetCursorOp(topic="alpha", subscription="s1", cursor=2)),
        _op(
            push_subscribe=replica_pb2.PushSubscribeOp(
                topic="beta", subscriber_id="ps", endpoint="127.0.0.1:1", retry_count=3
            )
        ),
    ]
    return [make_entry(i + 1, 1, op) for i, op in enumerate(ops)]


def _filled() -> Store:
    store = Store.open_memory()
    entries = _entries()
    store.append(entries, sync=False, commit_lsn=len(entries))
    store.set_cluster_id("fuzz-cluster")
    store.set_epoch(1)
    return store


# Every read the store offers, by name; each is compared before and after the damage.
READS: dict[str, Callable[[Store], Any]] = {
    "meta": lambda s: s.meta(),
    "counts": lambda s: s.counts(),
    "list_topics": lambda s: s.list_topics(),
    "get_topic": lambda s: (s.get_topic("alpha"), s.get_topic("beta")),
    "read_events": lambda s: [
        [e.SerializeToString() for e in s.read_events(t, 0, 100)] for t in ("alpha", "beta")
    ],
    "read_log": lambda s: [e.SerializeToString() for e in s.read_log(1, 100)],
    "cursors": lambda s: (s.get_cursor("alpha", "s1"), s.list_subscriptions("alpha")),
    "push": lambda s: (s.list_push_subscribers(), s.get_push_subscriber("beta", "ps")),
    "dedupe": lambda s: [s.lookup_sequence(p, q) for p in ("p1", "p2") for q in range(1, 7)],
    "high_water": lambda s: (s.publisher_high_water("p1"), s.publisher_high_water("p2")),
    "snapshot": lambda s: [
        [(r.db, r.key, r.value) for r in chunk.records] for chunk in s.snapshot_chunks()
    ],
    "uncommitted": lambda s: s.snapshot_uncommitted(),
}


def _all_records(store: Store) -> list[tuple[str, bytes, bytes]]:
    with store._kv.read() as txn:
        return [(db, k, v) for db in DATABASES for k, v in txn.scan(db)]


RECORDS = _all_records(_filled())
BASELINE = {name: read(_filled()) for name, read in READS.items()}


def _put_raw(store: Store, db: str, key: bytes, value: bytes) -> None:
    with store._kv.write(sync=False) as txn:
        txn.put(db, key, value)


def _mutations() -> st.SearchStrategy[Callable[[bytes], bytes]]:
    def flips(positions: list[tuple[int, int]]) -> Callable[[bytes], bytes]:
        def apply(value: bytes) -> bytes:
            data = bytearray(value)
            for at, bit in positions:
                if data:
                    data[at % len(data)] ^= 1 << bit
            return bytes(data)

        return apply

    return st.one_of(
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 7)), min_size=1, max_size=4).map(
            flips
        ),
        st.integers(0, 64).map(lambda n: lambda v: v[: min(n, max(len(v) - 1, 0))]),
        st.binary(min_size=1, max_size=16).map(lambda tail: lambda v: v + tail),
        st.binary(max_size=64).map(lambda data: lambda v: data),
    )


@given(record=st.sampled_from(RECORDS), mutate=_mutations())
def test_a_damaged_record_is_reported_as_corrupt_never_served(
    record: tuple[str, bytes, bytes], mutate: Callable[[bytes], bytes]
) -> None:
    db, key, value = record
    damaged = mutate(value)
    store = _filled()
    _put_raw(store, db, key, damaged)
    failed = []
    for name, read in READS.items():
        try:
            answer = read(store)
        except CorruptRecordError as exc:
            failed.append(name)
            assert db in str(exc), f"{name}: {exc} does not name {db}"
            continue
        assert answer == BASELINE[name], f"{name} answered differently over damaged {db}"
    if damaged != value:
        assert failed, f"no read noticed the damaged {db} record {key!r}"


@given(
    record=st.sampled_from(RECORDS),
    body=st.one_of(
        st.binary(max_size=80),
        st.tuples(st.integers(0, 200), st.binary(min_size=1, max_size=8)),
    ),
)
def test_a_hostile_body_behind_a_valid_checksum_never_crashes_a_read(
    record: tuple[str, bytes, bytes], body: bytes | tuple[int, bytes]
) -> None:
    db, key, value = record
    if isinstance(body, tuple):  # splice bytes into the real body, so most of it still fits
        at, patch = body
        real = value[4:]
        at %= len(real) + 1
        body = real[:at] + patch + real[at + len(patch) :]
    store = _filled()
    _put_raw(store, db, key, seal(key, body))
    for name, read in READS.items():
        try:
            read(store)
        except StoreError:
            pass
        except Exception as exc:  # the point: nothing but a StoreError may escape
            pytest.fail(f"{name} over a hostile {db} body {body!r}: {type(exc).__name__}: {exc}")


def _node(tmp_path: Path) -> ReplicaNode:
    text = (
        '[cluster]\nname = "t"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        'coordinator_address = "127.0.0.1:1"\nreplica_address = "127.0.0.1:2"\n'
        'data_dir = "n1"\n\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:3"\n'
    )
    config = parse_config(text, tmp_path / "cluster.toml")
    config.nodes[0].data_dir.mkdir(parents=True, exist_ok=True)
    return build_replica_node(config, config.nodes[0], _filled())


EVENT_RECORDS = [r for r in RECORDS if r[0] == "events"]


@given(record=st.sampled_from(EVENT_RECORDS), bit=st.integers(0, 8 * 24 - 1))
def test_a_replica_reading_a_damaged_event_answers_data_loss_and_quarantines(
    tmp_path_factory: pytest.TempPathFactory, record: tuple[str, bytes, bytes], bit: int
) -> None:
    db, key, value = record
    damaged = bytearray(value)
    damaged[(bit // 8) % len(damaged)] ^= 1 << (bit % 8)
    node = _node(tmp_path_factory.mktemp("quarantine"))

    async def scenario() -> None:
        await node.start()
        try:
            _put_raw(node.store, db, key, bytes(damaged))
            topic = "alpha" if any(key == k for _, k, _ in EVENT_RECORDS[:3]) else "beta"
            with pytest.raises(ServiceError) as refused, server._translating(node):
                node.store.read_events(topic, 0, 100)
            assert refused.value.code == Code.DATA_LOSS
            assert "corrupt record, not served" in refused.value.message
            assert node.fault is not None and "checksum error" in node.fault.reason
            saved = load_fault(node.node.data_dir)
            assert saved is not None and saved.fault_id == node.fault.fault_id
        finally:
            await node.stop()

    asyncio.run(scenario())
