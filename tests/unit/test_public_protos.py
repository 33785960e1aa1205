"""The public protos compile alone, and the breaking-change check against the last release.

Goal: a Go, Java or Node app compiles protos/squall/v1's public files without the
internal ones, and `make test` refuses a change that would break an app built against the
released descriptors (protos/released/public-descriptors.txtpb).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from google.protobuf import descriptor_pb2

from scripts.public_protos import (
    PUBLIC_PROTOS,
    breaking_changes,
    compile_public,
    load_snapshot,
)
from squall.v1 import broker_pb2, common_pb2
from squall_server.replica.batch_bytes import framed_event_bytes

Fds = descriptor_pb2.FileDescriptorSet


@pytest.fixture(scope="module")
def public() -> Fds:
    return compile_public()


def test_the_public_files_compile_alone_and_import_only_each_other(public: Fds) -> None:
    names = {f"squall/v1/{name}" for name in PUBLIC_PROTOS}
    assert {file.name for file in public.file} == names
    for file in public.file:
        assert set(file.dependency) <= names, file.name
    services = {s.name for file in public.file for s in file.service}
    assert {"TopicManager", "Publisher", "Subscriber", "PushSubscriptions"} <= services
    assert {"PushSubscriber", "ClusterAdmin"} <= services
    assert not {"Coordinator", "Replication", "ReplicaControl"} & services


def test_nothing_breaks_against_the_last_release(public: Fds) -> None:
    assert breaking_changes(load_snapshot(), public) == []


def _message(fds: Fds, name: str) -> descriptor_pb2.DescriptorProto:
    return next(m for f in fds.file for m in f.message_type if m.name == name)


def _field(fds: Fds, message: str, name: str) -> descriptor_pb2.FieldDescriptorProto:
    return next(f for f in _message(fds, message).field if f.name == name)


def _remove_payload(fds: Fds) -> None:
    fields = _message(fds, "Event").field
    fields.remove(next(f for f in fields if f.name == "payload"))


def _retype_offset(fds: Fds) -> None:
    _field(fds, "Event", "offset").type = descriptor_pb2.FieldDescriptorProto.TYPE_UINT32


def _rename_key(fds: Fds) -> None:
    field = _field(fds, "Event", "key")
    field.name, field.json_name = "event_key", "eventKey"


def _repeat_topic(fds: Fds) -> None:
    _field(
        fds, "SubscribeRequest", "topic"
    ).label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED


def _remove_ack(fds: Fds) -> None:
    service = next(s for f in fds.file for s in f.service if s.name == "Subscriber")
    service.method.remove(next(m for m in service.method if m.name == "Ack"))


def _unstream_subscribe(fds: Fds) -> None:
    service = next(s for f in fds.file for s in f.service if s.name == "Subscriber")
    next(m for m in service.method if m.name == "Subscribe").server_streaming = False


def _drop_enum_value(fds: Fds) -> None:
    enum = next(e for f in fds.file for e in f.enum_type if e.name == "TopicKind")
    enum.value.remove(next(v for v in enum.value if v.name == "TOPIC_KIND_TRANSIENT"))


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        (_remove_payload, "squall.v1.Event field 4 (payload) removed without reserving"),
        (_retype_offset, "squall.v1.Event field 2 (offset) changed type"),
        (_rename_key, "squall.v1.Event field 3 (key) renamed to event_key"),
        (_repeat_topic, "squall.v1.SubscribeRequest field 1 (topic) changed label"),
        (_remove_ack, "method squall.v1.Subscriber.Ack removed"),
        (_unstream_subscribe, "method squall.v1.Subscriber.Subscribe changed streaming"),
        (_drop_enum_value, "enum squall.v1.TopicKind value 2 (TOPIC_KIND_TRANSIENT) removed"),
    ],
)
def test_a_breaking_change_is_named(
    public: Fds, change: Callable[[Fds], None], reported: str
) -> None:
    changed = Fds()
    changed.CopyFrom(public)
    change(changed)
    problems = breaking_changes(public, changed)
    assert any(p.startswith(reported) for p in problems), problems


def test_additions_and_reserved_removals_are_not_breaking(public: Fds) -> None:
    changed = Fds()
    changed.CopyFrom(public)
    event = _message(changed, "Event")
    event.field.add(
        name="trace_parent",
        number=99,
        json_name="traceParent",
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    _remove_payload(changed)
    event.reserved_range.add(start=4, end=5)
    event.reserved_name.append("payload")
    assert breaking_changes(public, changed) == []


def test_the_response_byte_budget_counts_what_goes_on_the_wire() -> None:
    events = [
        common_pb2.Event(topic="t", offset=i, payload=b"x" * size, headers={"h": "v" * i})
        for i, size in enumerate([0, 1, 126, 127, 16_383, 16_384, 1_000_000, 2_097_152])
    ]
    response = broker_pb2.SubscribeResponse(events=events)
    assert sum(framed_event_bytes(e.ByteSize()) for e in events) == response.ByteSize()
