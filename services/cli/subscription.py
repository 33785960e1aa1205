"""`squall subscription seek|info`: move a durable subscription's cursor, or show where it is.

    squall subscription seek TOPIC NAME (--time ISO8601 | --offset N | --earliest | --latest)
    squall subscription info TOPIC NAME [--json]

A time is ISO 8601 with a timezone (`2026-11-25T09:00:00Z`, `...+01:00`); one without is
refused rather than guessed. See docs/consumers.md ("Seek").
"""

from __future__ import annotations

import argparse
import datetime
from typing import TextIO

import squall
from squall_server.cli import listing as cli_listing


def parse_time(value: str) -> datetime.datetime:
    """An ISO 8601 time with a timezone; argparse.ArgumentTypeError names a bad one."""
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an ISO 8601 time such as 2026-11-25T09:00:00Z, not {value!r}"
        ) from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"time {value!r} has no timezone: add Z (UTC) or an offset such as +01:00"
        )
    return moment


def parse_offset(value: str) -> int:
    """An offset argument: a whole number >= 0."""
    try:
        offset = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an offset, not {value!r}") from None
    if offset < 0:
        raise argparse.ArgumentTypeError(f"an offset must be >= 0, not {offset}")
    return offset


def add_parser(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    client: argparse.ArgumentParser,
) -> None:
    """Adds `subscription seek` and `subscription info` (client commands, via a gateway)."""
    subscription = commands.add_parser(
        "subscription", help="move a durable subscription's cursor, or show it"
    )
    actions = subscription.add_subparsers(
        dest="subscription_command", required=True, metavar="ACTION"
    )
    seek = actions.add_parser(
        "seek",
        parents=[client],
        help="move a durable subscription to a time, an offset, earliest or latest",
    )
    seek.add_argument("topic")
    seek.add_argument("name", metavar="SUBSCRIPTION")
    where = seek.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--time",
        type=parse_time,
        metavar="ISO8601",
        help="the first event published at or after this time (with a timezone, e.g. ...Z)",
    )
    where.add_argument("--offset", type=parse_offset, metavar="N", help="the event at offset N")
    where.add_argument("--earliest", action="store_true", help="the oldest event held")
    where.add_argument("--latest", action="store_true", help="past every event published")
    info = actions.add_parser(
        "info",
        parents=[client],
        help="a durable subscription's cursor and backlog (shared: outstanding, dead-lettered)",
    )
    info.add_argument("topic")
    info.add_argument("name", metavar="SUBSCRIPTION")
    cli_listing.add_json_flag(info)


def seek_target(args: argparse.Namespace) -> squall.SeekTarget:
    """Where `subscription seek`'s options say to go."""
    if args.time is not None:
        moment: datetime.datetime = args.time
        return moment
    if args.offset is not None:
        offset: int = args.offset
        return offset
    return "earliest" if args.earliest else "latest"


def seek_lines(result: squall.SeekResult) -> list[str]:
    """What `subscription seek` prints."""
    was = "created" if result.created else f"was {result.previous_cursor}"
    lines = [
        f"subscription {result.subscription} on topic {result.topic}: cursor "
        f"{result.cursor} ({was}), seek generation {result.seek_generation}"
    ]
    if result.clamped:
        lines.append(f"clamped: {result.note}")
    return lines


def info_document(info: squall.SubscriptionInfo, topic: squall.TopicInfo) -> dict[str, object]:
    """`subscription info`'s facts, as --json prints them."""
    document: dict[str, object] = {
        "topic": info.topic,
        "subscription": info.name,
        "cursor": info.cursor,
        "backlog": info.backlog,
        "seek_generation": info.seek_generation,
        "topic_first_offset": topic.first_offset,
        "topic_next_offset": topic.next_offset,
    }
    if info.shared:
        # Outstanding: leased by the master now; dead-lettered: sent to the dead-letter topic.
        document.update(shared=True, outstanding=info.outstanding, dead_lettered=info.dead_lettered)
    return document


def run(client: squall.Client, args: argparse.Namespace, out: TextIO) -> int:
    """Runs `squall subscription ...` against a connected client."""
    topic = client.topic(args.topic)
    if args.subscription_command == "seek":
        for line in seek_lines(topic.seek(args.name, seek_target(args))):
            print(line, file=out)
        return 0
    document = info_document(topic.subscription_info(args.name), topic.refresh())
    if args.json:
        cli_listing.print_json(document, out)
    else:
        for key, value in document.items():
            print(f"{key}\t{value}", file=out)
    return 0
