"""Seek in the clients and the CLI: requests built from what an app or a person says.

Goal: a time is sent as the first event at or after it only when it names its timezone;
acks name the seek generation of the stream that delivered the message, so a stale ack is
fenced by the server; `squall subscription seek` and `info` parse and print what they say.
"""

from __future__ import annotations

import argparse
import datetime

import grpc
import pytest

import squall
from squall._seek import SeekResult, position_fields, seek_request
from squall._subscriber import ack_request, moved_by_seek, subscribe_request
from squall._types import messages_from_pb
from squall.v1 import broker_pb2, common_pb2
from squall_server import cli
from squall_server.cli import subscription as cli_subscription

UTC = datetime.UTC


def test_a_time_is_a_timestamp_position_and_a_naive_one_is_refused() -> None:
    moment = datetime.datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
    assert position_fields(moment) == (broker_pb2.START_POSITION_TIMESTAMP, 0, 1_795_597_200_000)
    request = subscribe_request("t", "s", moment, True, 0)
    assert request.start == broker_pb2.START_POSITION_TIMESTAMP
    assert request.timestamp_ms == 1_795_597_200_000
    with pytest.raises(ValueError, match="needs a timezone"):
        seek_request("t", "s", datetime.datetime(2026, 11, 25, 9, 0))
    for bad in (-1, True, "soon", 1.5):
        with pytest.raises(ValueError, match="earliest"):
            seek_request("t", "s", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="durable subscription"):
        seek_request("t", "", "earliest")
    assert seek_request("t", "s", 7).offset == 7


def test_acks_name_the_generation_their_message_was_delivered_under() -> None:
    request = subscribe_request("t", "s", "earliest", True, 0)
    response = broker_pb2.SubscribeResponse(events=[common_pb2.Event(offset=4)], seek_generation=9)
    (message,) = messages_from_pb(response)
    # The message's own generation wins over the stream's current one.
    assert ack_request(request, message, generation=12).seek_generation == 9
    assert ack_request(request, 4, generation=12).seek_generation == 12
    # Before the stream answered, an offset's ack carries no generation: no check.
    assert not ack_request(request, 4).HasField("seek_generation")
    assert moved_by_seek(request, grpc.StatusCode.ABORTED)
    assert not moved_by_seek(request, grpc.StatusCode.UNAVAILABLE)
    plain = subscribe_request("t", None, "earliest", True, 0)
    assert not moved_by_seek(plain, grpc.StatusCode.ABORTED)


def test_cli_times_need_a_timezone() -> None:
    assert cli_subscription.parse_time("2026-11-25T09:00:00Z") == datetime.datetime(
        2026, 11, 25, 9, tzinfo=UTC
    )
    offset_time = cli_subscription.parse_time("2026-11-25T10:00:00+01:00")
    assert offset_time.astimezone(UTC).hour == 9
    with pytest.raises(argparse.ArgumentTypeError, match="no timezone"):
        cli_subscription.parse_time("2026-11-25T09:00:00")
    with pytest.raises(argparse.ArgumentTypeError, match="ISO 8601"):
        cli_subscription.parse_time("yesterday")


def test_cli_seek_and_subscribe_parse_their_positions() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["subscription", "seek", "t", "s", "--time", "2026-11-25T09:00:00Z"])
    assert cli_subscription.seek_target(args) == datetime.datetime(2026, 11, 25, 9, tzinfo=UTC)
    args = parser.parse_args(["subscription", "seek", "t", "s", "--offset", "3"])
    assert cli_subscription.seek_target(args) == 3
    args = parser.parse_args(["subscription", "seek", "t", "s", "--latest"])
    assert cli_subscription.seek_target(args) == "latest"
    with pytest.raises(SystemExit):
        parser.parse_args(["subscription", "seek", "t", "s"])  # a position is required
    with pytest.raises(SystemExit):
        parser.parse_args(["subscription", "seek", "t", "s", "--earliest", "--latest"])
    args = parser.parse_args(["subscribe", "t", "--from", "2026-11-25T09:00:00Z"])
    assert args.start == datetime.datetime(2026, 11, 25, 9, tzinfo=UTC)


def test_cli_seek_says_where_the_cursor_went_and_why_it_was_clamped() -> None:
    clamped = SeekResult("t", "s", 0, 20, False, True, "time ... is before the oldest event", 5)
    assert cli_subscription.seek_lines(clamped) == [
        "subscription s on topic t: cursor 0 (was 20), seek generation 5",
        "clamped: time ... is before the oldest event",
    ]
    created = SeekResult("t", "s", 6, 0, True, False, "", 7)
    assert cli_subscription.seek_lines(created) == [
        "subscription s on topic t: cursor 6 (created), seek generation 7"
    ]


def test_aborted_is_its_own_error() -> None:
    error = squall.from_rpc_error(_FakeError(grpc.StatusCode.ABORTED, "moved by a seek"))
    assert isinstance(error, squall.Aborted)


class _FakeError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
