"""A hostile configuration file is refused with ConfigError naming what is wrong, or
accepted; nothing else ever escapes the loader (issue 9, item 4).

Three kinds of input: the example configuration with one value replaced by a hostile one
(wrong type, extreme number, NaN, huge string, nested table, date...), a key removed or an
unknown key added, all written back as TOML; the example file's text with random edits;
and random bytes as a file. With a value replaced, the message names the field (its key,
or the section for a rule that spans fields); with bytes that are not UTF-8, the line.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from squall_server.common.config import ClusterConfig, ConfigError, load_config, parse_config
from tests.fuzz.proto_strategies import ODD_STRINGS

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
EXAMPLE_TEXT = EXAMPLE.read_text()
EXAMPLE_DOC = tomllib.loads(EXAMPLE_TEXT)

HOSTILE_VALUES = st.one_of(
    st.sampled_from(
        [
            -1,
            0,
            1,
            2**31,
            2**63 - 1,
            -(2**63),
            0.5,
            math.nan,
            math.inf,
            -math.inf,
            True,
            False,
            [],
            [1, "a"],
            {},
            {"x": 1},
            datetime.date(1979, 5, 27),
            datetime.datetime(1979, 5, 27, 7, 32),
            "127.0.0.1:0",
            "127.0.0.1:99999",
            "[::1]:7100",
            "0.0.0.0:1",
            "SYNC",
            "json",
            "DEBUG",
        ]
    ),
    ODD_STRINGS,
    st.integers(),
    st.text(max_size=30),
)


# --- a small TOML writer: enough for the configuration's shape (tables, arrays of tables,
# scalars, arrays and inline tables), so a mutated document goes back to the loader as text.


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _value(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # A TOML basic string: JSON's escapes are TOML's, but DEL must be escaped too.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(document: dict[str, Any]) -> str:
    lines: list[str] = []
    for name, section in document.items():
        if isinstance(section, list) and section and all(isinstance(t, dict) for t in section):
            for table in section:
                lines.append(f"[[{_key(name)}]]")
                lines.extend(f"{_key(k)} = {_value(v)}" for k, v in table.items())
        elif isinstance(section, dict):
            lines.append(f"[{_key(name)}]")
            lines.extend(f"{_key(k)} = {_value(v)}" for k, v in section.items())
        else:
            lines.insert(0, f"{_key(name)} = {_value(section)}")
    return "\n".join(lines) + "\n"


def _leaves(document: dict[str, Any]) -> list[tuple[str, int | None, str]]:
    """(section, index in an array of tables or None, key) of every value in the example."""
    found: list[tuple[str, int | None, str]] = []
    for name, section in document.items():
        if isinstance(section, list):
            found += [(name, i, k) for i, table in enumerate(section) for k in table]
        else:
            found += [(name, None, k) for k in section]
    return found


LEAVES = _leaves(EXAMPLE_DOC)


def _copy() -> dict[str, Any]:
    return tomllib.loads(EXAMPLE_TEXT)


def _parse(text: str, tmp: Path) -> ClusterConfig | ConfigError:
    """parse_config's result: a config or its ConfigError; any other exception escapes."""
    try:
        return parse_config(text, tmp / "cluster.toml")
    except ConfigError as error:
        assert str(error).strip(), "a ConfigError with no message"
        return error


def test_the_writer_round_trips_the_example(tmp_path: Path) -> None:
    assert tomllib.loads(to_toml(_copy())) == EXAMPLE_DOC
    assert isinstance(_parse(to_toml(_copy()), tmp_path), ClusterConfig)


@given(leaf=st.sampled_from(LEAVES), value=HOSTILE_VALUES)
def test_a_hostile_value_is_refused_naming_its_field_or_accepted(
    tmp_path_factory: Any, leaf: tuple[str, int | None, str], value: Any
) -> None:
    section, index, key = leaf
    document = _copy()
    table = document[section][index] if index is not None else document[section]
    table[key] = value
    result = _parse(to_toml(document), tmp_path_factory.getbasetemp())
    if isinstance(result, ConfigError):
        message = str(result)
        assert key in message or section in message, f"{section}.{key}={value!r}: {message}"


@given(
    leaf=st.sampled_from(LEAVES),
    extra=st.tuples(
        st.sampled_from([*EXAMPLE_DOC, "nodes", "auth", "tls", "x"]), st.text(max_size=12)
    ),
    extra_value=HOSTILE_VALUES,
    remove=st.booleans(),
)
def test_a_missing_or_unknown_key_is_refused_naming_it_or_accepted(
    tmp_path_factory: Any,
    leaf: tuple[str, int | None, str],
    extra: tuple[str, str],
    extra_value: Any,
    remove: bool,
) -> None:
    document = _copy()
    section, index, key = leaf
    if remove:
        table = document[section][index] if index is not None else document[section]
        del table[key]
    else:
        target, new_key = extra
        holder = document.setdefault(target, {})
        if isinstance(holder, list):
            holder = holder[0]
        holder[new_key or "k"] = extra_value
    result = _parse(to_toml(document), tmp_path_factory.getbasetemp())
    if isinstance(result, ConfigError) and remove:
        message = str(result)
        assert key in message or section in message, f"without {section}.{key}: {message}"


@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, len(EXAMPLE_TEXT)),
            st.integers(0, 8),
            st.one_of(st.text(max_size=8), st.sampled_from(["=", "[", "]", '"', "\n", "[[", "#"])),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_an_edited_example_file_parses_or_is_refused(
    tmp_path_factory: Any, edits: list[tuple[int, int, str]]
) -> None:
    text = EXAMPLE_TEXT
    for position, length, insert in edits:
        at = position % (len(text) + 1)
        text = text[:at] + insert + text[at + length :]
    _parse(text, tmp_path_factory.getbasetemp())


@given(
    data=st.one_of(
        st.binary(max_size=400), st.binary(max_size=40).map(lambda b: EXAMPLE_TEXT.encode() + b)
    )
)
def test_random_bytes_as_a_config_file_are_refused_cleanly(
    tmp_path_factory: Any, data: bytes
) -> None:
    path = Path(tmp_path_factory.getbasetemp()) / "random.toml"
    path.write_bytes(data)
    try:
        load_config(path)
    except ConfigError as error:
        assert str(error).strip()
        assert error.path == path
