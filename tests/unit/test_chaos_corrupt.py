"""The chaos harness's `corrupt` fault (chaos/faults.py): which record it damages, and how
it judges a read of the damaged event.

Goal: the fault only damages an event the node serves (committed), so a reader reaches
it; a read that does not end in DATA_LOSS is right only when the damage is gone from the
store (a node that truncated on rejoining rebuilt it from its untouched log) and the
event comes back intact; an altered event, or an undetected damaged record, is a finding.
"""

from __future__ import annotations

import random
from pathlib import Path

from chaos.faults import Damage, flip_event_byte, judge_undetected
from squall.v1 import common_pb2, replica_pb2
from squall_server.replica.store import Store, make_entry

MAP_BYTES = 16 << 20


def _store_with_hidden_tail(path: Path, committed: int, hidden: int) -> None:
    """A stopped store whose first `committed` events of topic t are committed and whose
    last `hidden` ones are above its recorded commit LSN."""
    store = Store.open_lmdb(path, MAP_BYTES)
    start = replica_pb2.Operation(epoch_start=replica_pb2.EpochStartOp(epoch=1, master_id="n1"))
    create = replica_pb2.Operation(create_topic=replica_pb2.CreateTopicOp(name="t"))
    publishes = [
        make_entry(
            3 + i,
            1,
            replica_pb2.Operation(
                publish=replica_pb2.PublishOp(
                    topic="t",
                    first_offset=i,
                    events=[common_pb2.EventData(payload=f"event {i:04d}".encode())],
                )
            ),
        )
        for i in range(committed + hidden)
    ]
    try:
        store.append(
            [make_entry(1, 1, start), make_entry(2, 1, create), *publishes],
            sync=True,
            commit_lsn=2 + committed,
        )
    finally:
        store.close()


def test_the_fault_damages_only_committed_events(tmp_path: Path) -> None:
    _store_with_hidden_tail(tmp_path, committed=3, hidden=5)
    for seed in range(20):
        copy = tmp_path / f"copy-{seed}"
        copy.mkdir()
        (copy / "data.mdb").write_bytes((tmp_path / "data.mdb").read_bytes())
        damage = flip_event_byte(copy, random.Random(seed))
        assert damage.topic == "t" and damage.offset < 3, damage.note
        assert damage.original is not None
        assert damage.original.payload == f"event {damage.offset:04d}".encode()
        assert damage.damaged in (copy / "data.mdb").read_bytes()


def _damage() -> Damage:
    original = common_pb2.Event(topic="t", offset=7, payload=b"intact")
    return Damage("t", 7, "flipped", original, b"damaged bytes")


def test_an_intact_event_is_right_only_once_the_damage_is_gone() -> None:
    damage = _damage()
    why, right = judge_undetected("OK", damage.original, damage, still_stored=False)
    assert right and "gone from the store" in why
    why, right = judge_undetected("OK", damage.original, damage, still_stored=True)
    assert not right and "NOT detected" in why


def test_an_altered_event_or_another_failure_is_a_finding() -> None:
    damage = _damage()
    altered = common_pb2.Event(topic="t", offset=7, payload=b"intacT")
    assert judge_undetected("OK", altered, damage, still_stored=False) == (
        "the node served the event ALTERED",
        False,
    )
    why, right = judge_undetected("UNAVAILABLE", None, damage, still_stored=True)
    assert not right and "UNAVAILABLE" in why
    why, right = judge_undetected("OK", None, damage, still_stored=False)
    assert not right and "did not serve the event" in why
