"""Loss reports on disk and on the wire: ``loss-events.json`` beside a node's store.

Whatever discards acknowledged events on a node — its replica truncating a suffix it knew
committed, ``squall store mark-clean``, ``squall store restore`` of an older backup — writes
a report here before (or as) it discards, and logs it at ERROR with the message id
``SQUALL-LOSS-001``. The file is beside the store, not in it, so the offline store tools can
write it with no process running, and a replica started later reports it to its
coordinator (``ReplicaState.losses``), which keeps it in ``coordinator-state.json`` and
shows it in ``squall status`` until an operator acknowledges it. Writing is atomic
(temporary file, fsync, rename); a report that cannot be written is still logged.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from pathlib import Path

from squall.v1 import common_pb2
from squall_server.common.durable_json import write_json_durably
from squall_server.common.loss_record import (
    LOSS_MESSAGE_ID,
    LOSS_RECORDS_MAX,
    LossRecord,
    LossRecordError,
    loss_from_dict,
)

LOSS_FILE_NAME = "loss-events.json"


def new_loss_id() -> str:
    """A short unique id an operator can type (`squall cluster ack-loss ID`)."""
    return f"loss-{uuid.uuid4().hex[:12]}"


def load_losses(data_dir: Path) -> tuple[LossRecord, ...]:
    """The reports recorded in data_dir (none when the file is missing).

    A damaged file is itself reported as one loss whose detail says so: it must not hide
    that something was discarded.
    """
    path = data_dir / LOSS_FILE_NAME
    try:
        document = json.loads(path.read_text())
        if not isinstance(document, list):
            raise LossRecordError("must hold a JSON list")
        return tuple(loss_from_dict(item, f"{path}[{i}]") for i, item in enumerate(document))[
            -LOSS_RECORDS_MAX:
        ]
    except FileNotFoundError:
        return ()
    except (OSError, ValueError) as exc:
        return (
            LossRecord(
                loss_id="loss-damaged-record",
                node_id="",
                at_ms=0,
                cause="unknown",
                operator_action="",
                detail=f"{path} is unreadable ({exc}); its reports are lost",
            ),
        )


def record_loss(
    data_dir: Path, record: LossRecord, logger: logging.Logger
) -> tuple[LossRecord, ...]:
    """Appends record to data_dir's reports (durably), logs it at ERROR with the stable
    message id, and returns every report now held. A write that fails is logged too."""
    logger.error(
        "%s acknowledged events discarded: %s [%s]",
        LOSS_MESSAGE_ID,
        record.summary(),
        record.loss_id,
    )
    held = tuple(r for r in load_losses(data_dir) if r.loss_id != record.loss_id)
    held = (*held, record)[-LOSS_RECORDS_MAX:]
    try:
        save_losses(data_dir, held)
    except OSError as exc:
        logger.error(
            "%s could not record loss report %s in %s (it is logged above): %s",
            LOSS_MESSAGE_ID,
            record.loss_id,
            data_dir / LOSS_FILE_NAME,
            exc,
        )
    return held


def save_losses(data_dir: Path, records: Iterable[LossRecord]) -> None:
    """Writes the reports atomically and durably."""
    data_dir.mkdir(parents=True, exist_ok=True)
    write_json_durably(data_dir / LOSS_FILE_NAME, [r.to_dict() for r in records])


def loss_to_proto(record: LossRecord) -> common_pb2.LossEvent:
    """The wire form."""
    return common_pb2.LossEvent(
        loss_id=record.loss_id,
        node_id=record.node_id,
        at_ms=record.at_ms,
        cause=record.cause,
        operator_action=record.operator_action,
        detail=record.detail,
        epoch=record.epoch,
        first_epoch=record.first_epoch,
        last_epoch=record.last_epoch,
        first_lsn=record.first_lsn,
        last_lsn=record.last_lsn,
        topics=[common_pb2.TopicLoss(topic=t, events=n) for t, n in record.topics],
    )


def loss_from_proto(message: common_pb2.LossEvent) -> LossRecord:
    """Back from the wire (a replica's report to its coordinator)."""
    return LossRecord(
        loss_id=message.loss_id[:64],
        node_id=message.node_id[:64],
        at_ms=message.at_ms,
        cause=message.cause[:64],
        operator_action=message.operator_action[:256],
        detail=message.detail[:2048],
        epoch=message.epoch,
        first_epoch=message.first_epoch,
        last_epoch=message.last_epoch,
        first_lsn=message.first_lsn,
        last_lsn=message.last_lsn,
        topics=tuple((t.topic, t.events) for t in message.topics[:33]),
    )
