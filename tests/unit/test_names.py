"""The name grammars: which topic, subscription, publisher and node names are accepted.

Rejections must quote the bad name and state the rule, because servers pass the message
to the client unchanged as INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from squall_server.common.names import (
    NODE_ID_MAX_CHARS,
    PUBLISHER_ID_MAX_BYTES,
    SUBSCRIPTION_NAME_MAX_BYTES,
    TOPIC_NAME_MAX_BYTES,
    validate_node_id,
    validate_publisher_id,
    validate_subscription_name,
    validate_topic_name,
)

DOTTED_VALIDATORS: list[tuple[str, Callable[[str], None], int]] = [
    ("topic name", validate_topic_name, TOPIC_NAME_MAX_BYTES),
    ("subscription name", validate_subscription_name, SUBSCRIPTION_NAME_MAX_BYTES),
]


def test_limits() -> None:
    assert TOPIC_NAME_MAX_BYTES == 255
    assert SUBSCRIPTION_NAME_MAX_BYTES == 255
    assert PUBLISHER_ID_MAX_BYTES == 128
    assert NODE_ID_MAX_CHARS == 64


@pytest.mark.parametrize(("what", "validate", "max_len"), DOTTED_VALIDATORS)
@pytest.mark.parametrize(
    "name",
    ["a", "orders", "Orders.EU-west_1", "0", "_internal", "a..b", "trailing.", "x-", "9.9.9"],
)
def test_dotted_names_accepted(
    what: str, validate: Callable[[str], None], max_len: int, name: str
) -> None:
    validate(name)


@pytest.mark.parametrize(("what", "validate", "max_len"), DOTTED_VALIDATORS)
def test_dotted_name_at_max_length(
    what: str, validate: Callable[[str], None], max_len: int
) -> None:
    validate("a" * max_len)
    with pytest.raises(ValueError, match=f"{max_len + 1} characters long"):
        validate("a" * (max_len + 1))


@pytest.mark.parametrize(("what", "validate", "max_len"), DOTTED_VALIDATORS)
@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "empty"),
        (".hidden", "starts with '.'"),
        ("-flag", "starts with '-'"),
        ("a b", "character ' ' at position 1 is not allowed"),
        ("a/b", "character '/' at position 1 is not allowed"),
        ("topic*", "character '*' at position 5 is not allowed"),
        ("caf\u00e9", "character '\u00e9' at position 3 is not allowed"),
        ("a\nb", "character '\\n' at position 1 is not allowed"),
        ("a:b", "character ':' at position 1 is not allowed"),
    ],
)
def test_dotted_names_rejected_with_name_and_rule(
    what: str, validate: Callable[[str], None], max_len: int, name: str, problem: str
) -> None:
    with pytest.raises(ValueError) as caught:
        validate(name)
    message = str(caught.value)
    assert message.startswith(f"invalid {what} {name!r}: ")
    assert problem in message
    assert f"{what}s are 1 to {max_len} characters from A-Z a-z 0-9 '.' '_' '-'" in message
    assert "do not start with '.' or '-'" in message


def test_huge_name_is_shortened_in_the_message() -> None:
    with pytest.raises(ValueError) as caught:
        validate_topic_name("x" * 10_000)
    message = str(caught.value)
    assert len(message) < 400
    assert "(10000 characters)" in message


@pytest.mark.parametrize("publisher_id", ["p", "spark-job/42:task#7", "a=b", "~!", "x" * 128])
def test_publisher_ids_accepted(publisher_id: str) -> None:
    validate_publisher_id(publisher_id)


@pytest.mark.parametrize(
    ("publisher_id", "problem"),
    [
        ("", "empty"),
        ("has space", "character ' ' at position 3"),
        ("tab\there", "character '\\t' at position 3"),
        ("\u00fcber", "character '\u00fc' at position 0"),
        ("nul\x00", "character '\\x00' at position 3"),
        ("x" * 129, "129 characters long"),
    ],
)
def test_publisher_ids_rejected(publisher_id: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_publisher_id(publisher_id)
    message = str(caught.value)
    assert message.startswith("invalid publisher id ")
    assert problem in message
    assert "publisher ids are 1 to 128 printable ASCII characters without spaces" in message


@pytest.mark.parametrize("node_id", ["n1", "node_A-2", "x" * 64])
def test_node_ids_accepted(node_id: str) -> None:
    validate_node_id(node_id)


@pytest.mark.parametrize(
    ("node_id", "problem"),
    [
        ("", "empty"),
        ("n.1", "character '.' at position 1"),
        ("n 1", "character ' ' at position 1"),
        ("x" * 65, "65 characters long"),
    ],
)
def test_node_ids_rejected(node_id: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_node_id(node_id)
    message = str(caught.value)
    assert message.startswith("invalid node id ")
    assert problem in message
    assert "node ids are 1 to 64 characters from A-Z a-z 0-9 '_' '-'" in message


def test_node_id_rule_names_what_it_checks() -> None:
    with pytest.raises(ValueError, match=r"^invalid gateway id 'g 1'.*gateway ids are 1 to 64"):
        validate_node_id("g 1", "gateway id")
