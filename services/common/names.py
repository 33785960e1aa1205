"""The name grammars of Squall: topics, durable subscriptions, publisher ids, node ids.

Names are part of the wire contract and the store's keys, so the grammar is fixed here
rather than configured: a name valid on one cluster is valid on every cluster. A cluster
may only be stricter about lengths ([limits] max_topic_name_bytes and friends). Each
validator raises ``ValueError`` with one sentence that quotes the bad name and states the
rule; servers turn it into ``INVALID_ARGUMENT`` unchanged. See docs/configuration.md.
"""

from __future__ import annotations

import re

# Names are ASCII only, so characters and bytes count the same.
TOPIC_NAME_MAX_BYTES = 255
SUBSCRIPTION_NAME_MAX_BYTES = 255
PUBLISHER_ID_MAX_BYTES = 128
NODE_ID_MAX_CHARS = 64

# Longest part of a bad name quoted back in an error, so a huge name cannot flood a log.
_SHOWN_CHARS_MAX = 80

_NAME_CHAR_RE = re.compile(r"[A-Za-z0-9._-]")
_NAME_FIRST_CHAR_RE = re.compile(r"[A-Za-z0-9_]")
_NODE_ID_CHAR_RE = re.compile(r"[A-Za-z0-9_-]")

_NAME_RULE = (
    "{what}s are 1 to {max_len} characters from A-Z a-z 0-9 '.' '_' '-' "
    "and do not start with '.' or '-'"
)
_PUBLISHER_ID_RULE = (
    f"publisher ids are 1 to {PUBLISHER_ID_MAX_BYTES} printable ASCII characters without spaces"
)
_NODE_ID_RULE = (
    "{what}s are 1 to " + str(NODE_ID_MAX_CHARS) + " characters from A-Z a-z 0-9 '_' '-'"
)


def show_name(name: str) -> str:
    """Quote a name for an error message, shortened when it is very long."""
    if len(name) <= _SHOWN_CHARS_MAX:
        return repr(name)
    return f"{name[:_SHOWN_CHARS_MAX]!r}... ({len(name)} characters)"


def _check_dotted_name(name: str, what: str, max_len: int) -> None:
    """Check the topic/subscription grammar, naming the first offending character."""
    rule = _NAME_RULE.format(what=what, max_len=max_len)
    if not name:
        raise ValueError(f"invalid {what} '': empty; {rule}")
    if len(name) > max_len:
        raise ValueError(f"invalid {what} {show_name(name)}: {len(name)} characters long; {rule}")
    for position, char in enumerate(name):
        if not _NAME_CHAR_RE.fullmatch(char):
            raise ValueError(
                f"invalid {what} {show_name(name)}: character {char!r} at position {position} "
                f"is not allowed; {rule}"
            )
    if not _NAME_FIRST_CHAR_RE.fullmatch(name[0]):
        raise ValueError(f"invalid {what} {show_name(name)}: starts with {name[0]!r}; {rule}")


def validate_topic_name(name: str) -> None:
    """Raise ValueError naming the topic name and the rule unless it fits the grammar."""
    _check_dotted_name(name, "topic name", TOPIC_NAME_MAX_BYTES)


def validate_subscription_name(name: str) -> None:
    """Raise ValueError naming the subscription name and the rule unless it fits."""
    _check_dotted_name(name, "subscription name", SUBSCRIPTION_NAME_MAX_BYTES)


def validate_push_subscriber_id(subscriber_id: str) -> None:
    """Raise ValueError naming the push subscriber id and the rule unless it fits.

    The same grammar as subscription names: an id is a key in the store, like a name.
    """
    _check_dotted_name(subscriber_id, "push subscriber id", SUBSCRIPTION_NAME_MAX_BYTES)


def validate_publisher_id(publisher_id: str) -> None:
    """Raise ValueError unless publisher_id is 1..128 printable ASCII without whitespace.

    An empty publisher id means "no deduplication" on the wire; callers that allow that
    check for it before calling this.
    """
    if not publisher_id:
        raise ValueError(f"invalid publisher id '': empty; {_PUBLISHER_ID_RULE}")
    if len(publisher_id) > PUBLISHER_ID_MAX_BYTES:
        raise ValueError(
            f"invalid publisher id {show_name(publisher_id)}: {len(publisher_id)} characters "
            f"long; {_PUBLISHER_ID_RULE}"
        )
    for position, char in enumerate(publisher_id):
        if not "!" <= char <= "~":
            raise ValueError(
                f"invalid publisher id {show_name(publisher_id)}: character {char!r} at "
                f"position {position} is not allowed; {_PUBLISHER_ID_RULE}"
            )


def validate_node_id(node_id: str, what: str = "node id") -> None:
    """Raise ValueError unless node_id is 1..64 of [A-Za-z0-9_-] (node, gateway, cluster)."""
    rule = _NODE_ID_RULE.format(what=what)
    if not node_id:
        raise ValueError(f"invalid {what} '': empty; {rule}")
    if len(node_id) > NODE_ID_MAX_CHARS:
        raise ValueError(
            f"invalid {what} {show_name(node_id)}: {len(node_id)} characters long; {rule}"
        )
    for position, char in enumerate(node_id):
        if not _NODE_ID_CHAR_RE.fullmatch(char):
            raise ValueError(
                f"invalid {what} {show_name(node_id)}: character {char!r} at position "
                f"{position} is not allowed; {rule}"
            )
