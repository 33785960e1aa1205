"""Hypothesis strategies that build ANY message of a protobuf descriptor, hostile values
included, and raw bytes parsed as a message type.

Every field kind is covered: all scalar types with their extremes (int64 min/max, uint64
max, NaN and infinities), strings from empty to larger than any limit (and names that pass
Squall's name grammar, so requests reach past the first check), bytes including invalid
UTF-8, enums with unknown values (proto3 enums are open), nested messages to a bounded
depth, repeated fields, maps and oneofs (at most one member set, as the wire allows).

Fields that name a network address (``*address``, ``endpoint``) only ever get loopback
forms: the services dial what such fields name, and tests talk only to 127.0.0.0/8.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor as d
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

_FD = d.FieldDescriptor

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)


# Values near the edges that off-by-one and overflow bugs live at.
def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted(
        {
            v
            for v in (low, low + 1, -1, 0, 1, 2, 255, 256, 65535, 2**31 - 1, 2**32, high - 1, high)
            if low <= v <= high
        }
    )
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 64))


# Names that pass the name grammar (and the one topic the fuzz cluster holds), so a
# request gets past "invalid name" to the code behind it.
NAMES = st.one_of(
    st.sampled_from(["fz", "fz.sub", "fz-2", "_x"]),
    st.sampled_from([255, 256]).map(lambda n: "a" * n),
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,24}", fullmatch=True),
)

# Strings to trouble a parser or a log line: control characters, separators, path tricks,
# lookalikes, a credential-looking value, and sizes past the name and key limits.
ODD_STRINGS = st.one_of(
    st.sampled_from([256, 511, 4097, 70_000]).map(lambda n: "x" * n),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "a\x00b",
            "\n\r\t",
            "../../etc/passwd",
            "/",
            ".",
            "..",
            "-",
            "é" * 200,
            "\u202e\u200b",
            "😀" * 64,
            "\ud7ff\ue000\uffff",
            "%s%n%x",
            "'; DROP TABLE topics; --",
            "authorization: Bearer abc",
        ]
    ),
)

TEXT = st.one_of(NAMES, ODD_STRINGS, st.text(max_size=40))

BYTES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"\xff\xfe\xfd", b"\xc3\x28", b"\xed\xa0\x80", b"\x00" * 300]),
    st.binary(min_size=2000, max_size=5000),
)

LOOPBACK_ADDRESSES = st.one_of(
    st.builds(lambda port: f"127.0.0.1:{port}", st.integers(0, 70_000)),
    st.sampled_from(
        ["", "127.0.0.1", "127.0.0.1:", ":1", "[::1]:1", "127.0.0.1:-1", "127.0.0.1:x"]
    ),
)

_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]),
)
_FLOAT32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0]),
)


# Fields that name a topic, subscription or publisher: mostly names that pass the grammar
# (often the topic that exists), so requests reach the code behind the name check.
_NAME_FIELDS = frozenset({"topic", "name", "subscription", "subscriber_id", "publisher_id"})
NAMED = st.one_of(st.just("fz"), st.just("fz"), NAMES, TEXT)


def _is_address(field: d.FieldDescriptor) -> bool:
    return field.name.endswith("address") or field.name == "endpoint"


def _scalar(field: d.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (_FD.TYPE_INT32, _FD.TYPE_SINT32, _FD.TYPE_SFIXED32):
        return _ints(*INT32)
    if t in (_FD.TYPE_INT64, _FD.TYPE_SINT64, _FD.TYPE_SFIXED64):
        return _ints(*INT64)
    if t in (_FD.TYPE_UINT32, _FD.TYPE_FIXED32):
        return _ints(*UINT32)
    if t in (_FD.TYPE_UINT64, _FD.TYPE_FIXED64):
        return _ints(*UINT64)
    if t == _FD.TYPE_BOOL:
        return st.booleans()
    if t == _FD.TYPE_DOUBLE:
        return _FLOATS
    if t == _FD.TYPE_FLOAT:
        return _FLOAT32
    if t == _FD.TYPE_STRING:
        if _is_address(field):
            return LOOPBACK_ADDRESSES
        return NAMED if field.name in _NAME_FIELDS else TEXT
    if t == _FD.TYPE_BYTES:
        return BYTES
    if t == _FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(*INT32))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def _field_value(field: d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    """A strategy for one (non-repeated) value of field; None: too deep to nest further."""
    if field.type in (_FD.TYPE_MESSAGE, _FD.TYPE_GROUP):
        if depth <= 0:
            return None
        return messages(field.message_type, depth - 1)
    return _scalar(field)


def _is_map(field: d.FieldDescriptor) -> bool:
    return (
        field.type == _FD.TYPE_MESSAGE
        and field.message_type.GetOptions().map_entry
        and _is_repeated(field)
    )


def _is_repeated(field: d.FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _setter(
    field: d.FieldDescriptor, depth: int
) -> st.SearchStrategy[Callable[[Message], None]] | None:
    """A strategy for a function that sets field on a message (None: cannot, too deep)."""
    name = field.name
    if _is_map(field):
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        value = _field_value(value_field, depth)
        if value is None:
            return None
        entries = st.dictionaries(_scalar(key_field), value, max_size=4)

        def set_map(entries_value: dict[Any, Any]) -> Callable[[Message], None]:
            def apply(message: Message) -> None:
                target = getattr(message, name)
                for key, item in entries_value.items():
                    if isinstance(item, Message):
                        target[key].CopyFrom(item)
                    else:
                        target[key] = item

            return apply

        return entries.map(set_map)
    value = _field_value(field, depth)
    if value is None:
        return None
    if _is_repeated(field):
        many = st.lists(value, max_size=5)

        def set_list(items: list[Any]) -> Callable[[Message], None]:
            def apply(message: Message) -> None:
                target = getattr(message, name)
                for item in items:
                    if isinstance(item, Message):
                        target.add().CopyFrom(item)
                    else:
                        target.append(item)

            return apply

        return many.map(set_list)

    def set_one(item: Any) -> Callable[[Message], None]:
        def apply(message: Message) -> None:
            if isinstance(item, Message):
                getattr(message, name).CopyFrom(item)
            else:
                setattr(message, name, item)

        return apply

    return value.map(set_one)


_cache: dict[tuple[str, int], st.SearchStrategy[Any]] = {}


def messages(descriptor: d.Descriptor, depth: int = 3) -> st.SearchStrategy[Any]:
    """Any message of descriptor's type: every field may be set, to any value of its type."""
    cache_key = (descriptor.full_name, depth)
    if cache_key in _cache:
        return _cache[cache_key]
    cls = _message_class(descriptor)
    plain = [f for f in descriptor.fields if f.containing_oneof is None or _synthetic(f)]
    parts: list[st.SearchStrategy[Callable[[Message], None] | None]] = []
    for field in plain:
        setter = _setter(field, depth)
        if setter is None:
            continue
        # A name field is always set (NAMED includes ""): unset, it is a request for
        # nothing, refused before any interesting code runs.
        always = field.name in _NAME_FIELDS and field.type == _FD.TYPE_STRING
        parts.append(setter if always and not _is_repeated(field) else st.none() | setter)
    for oneof in descriptor.oneofs:
        if _synthetic_oneof(oneof):
            continue
        choices = [s for f in oneof.fields if (s := _setter(f, depth)) is not None]
        if choices:
            parts.append(st.none() | st.one_of(choices))

    def build(setters: list[Callable[[Message], None] | None]) -> Message:
        message = cls()
        for apply in setters:
            if apply is not None:
                apply(message)
        return message

    strategy = st.tuples(*parts).map(lambda t: build(list(t))) if parts else st.just(cls())
    _cache[cache_key] = strategy
    return strategy


def _synthetic_oneof(oneof: d.OneofDescriptor) -> bool:
    # proto3 `optional` fields live in a synthetic oneof of their own.
    return len(oneof.fields) == 1 and oneof.name.startswith("_")


def _synthetic(field: d.FieldDescriptor) -> bool:
    oneof = field.containing_oneof
    return oneof is not None and _synthetic_oneof(oneof)


def _message_class(descriptor: d.Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def parsed_bytes(descriptor: d.Descriptor) -> st.SearchStrategy[Any]:
    """Raw random bytes (and mutations of a valid encoding) that parse as descriptor's type.

    Bytes that do not parse at all are not the servicer's business (gRPC refuses them before
    any handler runs); those that do parse carry the wire's oddities: unknown fields,
    repeated scalars where one is expected, and out-of-range enum values.
    """
    cls = _message_class(descriptor)

    def parse(data: bytes) -> Message | None:
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeError, ValueError):
            return None

    def mutate(pair: tuple[Message, list[tuple[int, int]]]) -> bytes:
        raw = bytearray(pair[0].SerializeToString())
        for position, value in pair[1]:
            if raw:
                raw[position % len(raw)] = value
        return bytes(raw)

    mutated = st.tuples(
        messages(descriptor, 2),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
    ).map(mutate)
    return (
        st.one_of(st.binary(max_size=300), mutated)
        .map(parse)
        .filter(lambda m: m is not None)
        .map(loopback_only)
    )


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in ("", "127.0.0.1", "[::1]", "localhost")


def loopback_only(message: Message) -> Message:
    """message with every address field that names a host off loopback pointed at it."""
    for field, value in message.ListFields():
        if field.type == _FD.TYPE_MESSAGE:
            if _is_map(field):
                items = (
                    list(value.values())
                    if field.message_type.fields_by_name["value"].type == _FD.TYPE_MESSAGE
                    else []
                )
            else:
                items = list(value) if _is_repeated(field) else [value]
            for item in items:
                loopback_only(item)
        elif field.type == _FD.TYPE_STRING and _is_address(field):
            if _is_repeated(field):
                for i, item in enumerate(value):
                    if not _loopback(item):
                        value[i] = "127.0.0.1:1"
            elif not _loopback(value):
                setattr(message, field.name, "127.0.0.1:1")
    return message
