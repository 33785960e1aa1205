"""grpcio's report of a client that went away mid-stream becomes one INFO line."""

from __future__ import annotations

import logging

import pytest

from squall_server.common import grpc_log


def _record(msg: str, args: tuple[object, ...] = ()) -> logging.LogRecord:
    try:
        raise RuntimeError("Failed execute_batch")
    except RuntimeError:
        import sys

        exc_info = sys.exc_info()
    return logging.LogRecord(grpc_log.GRPC_LOGGER, logging.ERROR, "x", 1, msg, args, exc_info)


@pytest.mark.parametrize(
    ("msg", "args"),
    [
        (
            "ExecuteBatchError raised in core by servicer method [%s]",
            ("/squall.v1.Subscriber/Subscribe",),
        ),
        (
            "ExecuteBatchError raised in core by servicer method [/squall.v1.Subscriber/Subscribe]",
            (),
        ),
    ],
)
def test_a_failed_write_to_a_gone_client_is_one_info_line(
    msg: str, args: tuple[object, ...]
) -> None:
    record = _record(msg, args)
    logging.getLogger().setLevel(logging.INFO)
    assert grpc_log.ClientGoneFilter().filter(record)
    assert record.levelno == logging.INFO and record.levelname == "INFO"
    assert record.exc_info is None  # no traceback
    assert record.getMessage().startswith(
        "client went away mid-stream: /squall.v1.Subscriber/Subscribe ended"
    )


def test_other_grpc_errors_are_left_alone() -> None:
    record = _record("Unexpected [%s] raised by servicer method [%s]", ("TypeError", "/a/B"))
    assert grpc_log.ClientGoneFilter().filter(record)
    assert record.levelno == logging.ERROR and record.exc_info is not None
