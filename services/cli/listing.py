"""`--json` for the CLI's listing commands (`topic list`, `topic subscribers`, `topic links`).

Each prints one JSON object, keys sorted, for scripts and `jq`: the same fields the text
table shows, with their full names and unabbreviated values (`status --json` and
`store inspect --json` print their own documents).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from typing import Any, TextIO

import squall


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """The one --json option every listing command takes."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def topics_document(topics: Iterable[squall.TopicInfo]) -> dict[str, Any]:
    """`topic list --json`: {"topics": [{name, kind, first_offset, next_offset, created_ms,
    size_bytes}]} (size_bytes null when the server does not count it)."""
    return {"topics": [dataclasses.asdict(info) for info in topics]}


def size_text(info: squall.TopicInfo) -> str:
    """A topic's size_bytes as the text tables show it: n/a when not counted."""
    return "n/a" if info.size_bytes is None else str(info.size_bytes)


def subscribers_document(
    topic: str, subscribers: Iterable[squall.PushSubscriberInfo]
) -> dict[str, Any]:
    """`topic subscribers NAME --json`: the topic and its push subscribers, QoS spelled out."""
    rows = []
    for sub in subscribers:
        row = dataclasses.asdict(sub)
        row["qos"] = dict(sub.qos)
        row["retry_count"] = sub.retry_count
        row["ordered"] = sub.ordered
        rows.append(row)
    return {"topic": topic, "subscribers": rows}


def links_document(links: Iterable[squall.LinkInfo]) -> dict[str, Any]:
    """`topic links [NAME] --json`: {"links": [{from_topic, to_topic, cost, start_offset,
    next_offset, lag_events, publisher_id, created_lsn}]}."""
    return {"links": [dataclasses.asdict(link) for link in links]}


def link_lines(links: Iterable[squall.LinkInfo]) -> list[str]:
    """The text rows of `topic links`, `topic info` and `status`."""
    return [
        f"{link.from_topic} -> {link.to_topic}{'@' + link.to_cluster if link.to_cluster else ''}"
        f"\tcost={link.cost}\tnext_offset={link.next_offset}\tlag_events={link.lag_events}"
        f"\tlag_ms={link.lag_ms}\tpublisher_id={link.publisher_id}"
        + (f"\tSTOPPED: {link.stopped_reason}" if link.stopped_reason else "")
        for link in links
    ]


def print_json(document: dict[str, Any], out: TextIO) -> None:
    """One indented JSON document with sorted keys."""
    print(json.dumps(document, indent=2, sort_keys=True), file=out)
