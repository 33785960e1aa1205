"""Loss reports (issue 20): whenever acknowledged events are discarded, the node records
what, where and what allowed it, logs it at ERROR as SQUALL-LOSS-001, and its coordinator
shows it until an operator acknowledges it.

* A slave truncating entries it knew committed (a new master formed under a quorum
  override) records the LSN range, epochs and events per topic before it truncates.
* Entries above the commit LSN it knew (never acknowledged) are truncated silently.
* `store mark-clean` of a dirty store and `store restore` of a backup older than the node's
  epoch record one; a clean store, or a backup at the node's epoch, do not.
* The coordinator keeps each report once, persists it, and an acknowledgement (audited)
  removes it for good; an unknown id is NOT_FOUND and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
from pathlib import Path

import pytest

from squall.v1 import common_pb2, replica_pb2
from squall_server.cli import store as store_cli
from squall_server.cli.store_backup import restore_loss
from squall_server.common.config import load_config
from squall_server.common.loss import LOSS_FILE_NAME, load_losses, record_loss
from squall_server.common.loss_record import LOSS_MESSAGE_ID, LossRecord
from squall_server.coordinator.election import Election, ElectionConfig
from squall_server.coordinator.messages import PersistedState
from squall_server.coordinator.persist import load_state, save_state
from squall_server.replica import backup as store_backup
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.rebuild import LmdbTruncator
from squall_server.replica.server import ReplicaControl
from squall_server.replica.store import Store
from tests.observability_harness import Otel, otel
from tests.unit.test_store_contract import (
    Writer,
    create,
    epoch_start,
    make_entry,
    payloads,
    publish,
)

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
MAP_BYTES = 16 << 20
__all__ = ["otel"]  # the fixture, imported for pytest


def _slave_of(master: str, epoch: int, seq: int) -> replica_pb2.RoleCommand:
    return replica_pb2.RoleCommand(
        seq=seq,
        epoch=epoch,
        role=common_pb2.ROLE_SLAVE,
        master=common_pb2.NodeEndpoint(node_id=master),
        lease_ms=60_000,
    )


async def _batch(node: ReplicaNode, stream: int, batch: replica_pb2.EntryBatch) -> None:
    async for _ in node.replication_batch(stream, batch):
        pass


def _truncating_slave(
    tmp_path: Path, commit_lsn: int
) -> tuple[ReplicaNode, replica_pb2.ReplicaState]:
    """n2 follows n1 in epoch 3 and stores LSNs 1..6 (topics `orders` and `audit`, then
    publishes of 2 and 3 events to `orders` and 4 to `audit`) knowing commit_lsn committed;
    then n3, master of epoch 5 (formed under an override), truncates it after LSN 3.
    Returns the node (stopped) and the state it reported to its coordinator."""
    config = load_config(CONFIG)
    node_config = dataclasses.replace(config.node("n2"), data_dir=tmp_path)

    async def scenario() -> tuple[ReplicaNode, replica_pb2.ReplicaState]:
        store = Store.open_lmdb(tmp_path, MAP_BYTES)
        truncator = LmdbTruncator(tmp_path, map_size_bytes=MAP_BYTES, dedupe_window=1000)
        node = build_replica_node(config, node_config, store, truncator=truncator)
        await node.start()
        try:
            await node.apply_role(_slave_of("n1", epoch=3, seq=1))
            hello = replica_pb2.ReplicationHello(master_id="n1", epoch=3, cluster_id="c-test")
            stream, _ = await node.replication_hello(hello)
            entries = Writer(store, epoch=3).entries(
                epoch_start(3),
                create("orders"),
                create("audit"),
                publish("orders", 0, payloads(2)),
                publish("orders", 2, payloads(3)),
                publish("audit", 0, payloads(4)),
            )
            await _batch(
                node, stream, replica_pb2.EntryBatch(epoch=3, entries=entries, commit_lsn=0)
            )
            # An empty batch: the master tells what is committed.
            await _batch(
                node, stream, replica_pb2.EntryBatch(epoch=3, entries=[], commit_lsn=commit_lsn)
            )
            await node.apply_role(_slave_of("n3", epoch=5, seq=2))
            hello = replica_pb2.ReplicationHello(master_id="n3", epoch=5, cluster_id="c-test")
            stream, position = await node.replication_hello(hello)
            assert position.last_lsn == 6
            await _batch(
                node,
                stream,
                replica_pb2.EntryBatch(
                    epoch=5,
                    entries=[make_entry(4, 5, epoch_start(5))],
                    commit_lsn=0,
                    truncate_after_lsn=3,
                ),
            )
            assert node.store.meta().last_lsn == 4
            return node, ReplicaControl(node)._state()
        finally:
            await node.stop()
            node.store.close()

    return asyncio.run(scenario())


def test_a_slave_truncating_what_it_knew_committed_records_a_loss_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, otel: Otel
) -> None:
    with caplog.at_level(logging.ERROR, logger="squall.replica"):
        node, state = _truncating_slave(tmp_path, commit_lsn=5)
    [loss] = node.losses
    assert loss.cause == "truncation" and loss.node_id == "n2"
    assert (loss.first_lsn, loss.last_lsn) == (4, 5)
    assert (loss.epoch, loss.first_epoch, loss.last_epoch) == (5, 3, 3)
    assert loss.topics == (("orders", 5),)  # LSNs 4 and 5: 2 + 3 events (6 was not known)
    assert "quorum override or a designated primary" in loss.operator_action
    assert "master n3" in loss.detail
    # Durable beside the store, logged with the stable id, and in the replica's state.
    assert load_losses(tmp_path) == (loss,)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(LOSS_MESSAGE_ID in m and loss.loss_id in m and "LSN 4..5" in m for m in errors)
    assert [(s.loss_id, s.first_lsn, s.last_lsn) for s in state.losses] == [(loss.loss_id, 4, 5)]
    assert [(t.topic, t.events) for t in state.losses[0].topics] == [("orders", 5)]
    # Counted in the replica's metrics.
    reports = otel.points("squall.replica.loss.reports")
    assert reports == [({"node": "n2", "cause": "truncation"}, 1)]
    assert otel.points("squall.replica.loss.events") == [({"node": "n2"}, 5)]


def test_truncating_only_what_was_never_known_committed_records_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="squall.replica"):
        node, state = _truncating_slave(tmp_path, commit_lsn=3)
    assert node.losses == () and not state.losses
    assert not (tmp_path / LOSS_FILE_NAME).exists()
    assert not any(LOSS_MESSAGE_ID in r.getMessage() for r in caplog.records)


def _record(loss_id: str = "loss-abc") -> LossRecord:
    return LossRecord(
        loss_id=loss_id,
        node_id="n2",
        at_ms=1_700_000_000_000,
        cause="truncation",
        operator_action="quorum override",
        detail="test",
        epoch=5,
        first_epoch=3,
        last_epoch=3,
        first_lsn=3,
        last_lsn=4,
        topics=(("orders", 5),),
    )


def test_reports_survive_a_reload_and_a_damaged_file_is_itself_reported(tmp_path: Path) -> None:
    record_loss(tmp_path, _record("loss-1"), logging.getLogger("test"))
    held = record_loss(tmp_path, _record("loss-2"), logging.getLogger("test"))
    assert [r.loss_id for r in held] == ["loss-1", "loss-2"]
    assert load_losses(tmp_path) == held
    (tmp_path / LOSS_FILE_NAME).write_text("{not json")
    [damaged] = load_losses(tmp_path)
    assert "unreadable" in damaged.detail


def _mark_clean_store(tmp_path: Path, state: int) -> Path:
    data = tmp_path / "n2"
    data.mkdir()
    store = Store.open_lmdb(data, MAP_BYTES)
    try:
        store.set_cluster_id("c-test")
        w = Writer(store)
        w.append(epoch_start(1), create("t"), publish("t", 0, payloads(3)))
        store.set_state(state, "old" if state == common_pb2.STORE_STATE_CLEAN else "")
    finally:
        store.close()
    return data


def test_mark_clean_of_a_dirty_store_records_a_manual_recovery_loss(tmp_path: Path) -> None:
    data = _mark_clean_store(tmp_path, common_pb2.STORE_STATE_DIRTY)
    out = io.StringIO()
    store_cli.mark_clean(str(data), "manual-1", out)
    [loss] = load_losses(data)
    assert loss.cause == "manual-recovery"
    assert "squall store mark-clean by" in loss.operator_action
    assert loss.first_lsn == 4 and loss.last_lsn == 0  # whatever came after this log
    assert f"recorded loss report {loss.loss_id}" in out.getvalue()
    # Marking it clean again (already clean) records nothing more.
    store_cli.mark_clean(str(data), "manual-1", io.StringIO())
    assert len(load_losses(data)) == 1


def test_mark_clean_of_a_clean_store_records_nothing(tmp_path: Path) -> None:
    data = _mark_clean_store(tmp_path, common_pb2.STORE_STATE_CLEAN)
    store_cli.mark_clean(str(data), "manual-2", io.StringIO())
    assert load_losses(data) == ()


def test_a_restore_older_than_the_node_records_a_loss(tmp_path: Path) -> None:
    info = store_backup.BackupInfo(
        source="/var/lib/squall/n2",
        host="h",
        created_unix_s=0.0,
        cluster_id="c",
        store_state="dirty",
        epoch=4,
        last_lsn=120,
        last_epoch=4,
        log_start_lsn=1,
        topics=1,
        state_records=3,
        data_bytes=1,
    )
    assert restore_loss("n2", info, 4, "dave", 1) is None  # the node never ran past it
    loss = restore_loss("n2", info, 9, "dave", 1)
    assert loss is not None and loss.cause == "restore"
    assert loss.first_lsn == 121 and loss.epoch == 9
    assert "squall store restore by dave" == loss.operator_action


def _election(persisted: PersistedState | None = None) -> Election:
    config = ElectionConfig(node_id="2", priorities={"1": 2, "2": 1, "3": 3})
    return Election(config, persisted or PersistedState(), lambda: "g")


def test_the_coordinator_keeps_each_report_once_until_acknowledged(tmp_path: Path) -> None:
    election = _election()
    ready = election.replica_losses((_record(),), 10)
    assert ready.persist is not None and ready.persist.losses == (_record(),)
    assert any(LOSS_MESSAGE_ID in e.message for e in ready.events)
    assert election.replica_losses((_record(),), 20).persist is None  # held already
    # Persisted and read back as it was.
    path = tmp_path / "coordinator-state.json"
    save_state(path, election.persisted)
    assert load_state(path) == election.persisted

    refused = election.ack_loss("loss-other", "carol", 30)
    assert refused.rejection is not None and refused.rejection.code.status == "NOT_FOUND"
    assert "loss-abc" in refused.rejection.message and refused.persist is None
    assert election.status().losses == (_record(),)

    done = election.ack_loss("loss-abc", "carol", 40, "replayed from the source")
    assert done.persist is not None and done.persist.losses == ()
    assert election.status().audit[-1].action == "ack-loss loss-abc"
    assert election.status().audit[-1].operator == "carol"
    # The replica still reports it: an acknowledged report does not come back.
    assert election.replica_losses((_record(),), 50).persist is None
    assert election.status().losses == ()
    save_state(path, election.persisted)
    assert json.loads(path.read_text())["acked_loss_ids"] == ["loss-abc"]
