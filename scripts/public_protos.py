"""The public protos (what apps in any language compile) and the check that keeps them compatible.

`protos/squall/v1` holds both the public API (the files in PUBLIC_PROTOS) and the internal
protocols between coordinators and replicas. An app compiles the public files alone, so
they must not import an internal one; `compile_public` proves it by running protoc on a
copy of just those files.

`check` compares the public descriptors with the committed snapshot of the last release
(RELEASED_SNAPSHOT) and fails on a change that breaks an app built from that release: a
removed service, method, message, field or enum value; a field whose number, type, label,
name or oneof changed; a method whose types or streaming changed. Adding is always fine.
`snapshot` rewrites the snapshot from the current protos: a release runs it (`make
protos-release`) and commits the result with the release's CHANGELOG entry.

    python scripts/public_protos.py check | snapshot
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from google.protobuf import descriptor_pb2, text_format

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PUBLIC_PROTOS = ("common.proto", "broker.proto", "push.proto", "gateway.proto")
RELEASED_SNAPSHOT = PROTO_ROOT / "released" / "public-descriptors.txtpb"
_SNAPSHOT_HEADER = (
    "# The public protos' descriptors as of the last release (scripts/public_protos.py).\n"
    "# `make test` fails on a change that breaks an app built from it; a release rewrites\n"
    "# it with `make protos-release`. Do not edit by hand.\n"
)

_Fds = descriptor_pb2.FileDescriptorSet


def copy_public_protos(dest: Path) -> Path:
    """Copies the public .proto files alone under dest/squall/v1; returns dest."""
    target = dest / "squall" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    for name in PUBLIC_PROTOS:
        shutil.copy2(PROTO_ROOT / "squall" / "v1" / name, target / name)
    return dest


def compile_public() -> _Fds:
    """The public files' descriptors, compiled by protoc with nothing else on its path."""
    with tempfile.TemporaryDirectory() as tmp:
        root = copy_public_protos(Path(tmp) / "protos")
        out = Path(tmp) / "public.binpb"
        files = [f"squall/v1/{name}" for name in PUBLIC_PROTOS]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{root}",
                f"--descriptor_set_out={out}",
                *files,
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(
                "the public protos do not compile on their own (an internal import?):\n"
                + result.stdout
                + result.stderr
            )
        return _Fds.FromString(out.read_bytes())


def load_snapshot(path: Path = RELEASED_SNAPSHOT) -> _Fds:
    """The committed descriptors of the last release."""
    return text_format.Parse(path.read_text(), _Fds())


def _messages(
    prefix: str,
    messages: Iterator[descriptor_pb2.DescriptorProto] | list[descriptor_pb2.DescriptorProto],
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for message in messages:
        name = f"{prefix}.{message.name}"
        yield name, message
        yield from _messages(name, list(message.nested_type))


def _index(fds: _Fds) -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
    messages: dict[str, object] = {}
    enums: dict[str, object] = {}
    services: dict[str, object] = {}
    for file in fds.file:
        package = f".{file.package}" if file.package else ""
        for enum in file.enum_type:
            enums[f"{package}.{enum.name}"] = enum
        for name, message in _messages(package, list(file.message_type)):
            messages[name] = message
            for enum in message.enum_type:
                enums[f"{name}.{enum.name}"] = enum
        for service in file.service:
            services[f"{package}.{service.name}"] = service
    return messages, enums, services


def _reserved(message: descriptor_pb2.DescriptorProto, number: int, name: str) -> bool:
    numbers = any(r.start <= number < r.end for r in message.reserved_range)
    return numbers and name in message.reserved_name


def breaking_changes(old: _Fds, new: _Fds) -> list[str]:
    """What in `new` breaks an app built against `old` (wire, JSON or generated code)."""
    problems: list[str] = []
    old_messages, old_enums, old_services = _index(old)
    new_messages, new_enums, new_services = _index(new)
    for name, before in old_messages.items():
        assert isinstance(before, descriptor_pb2.DescriptorProto)
        after = new_messages.get(name)
        if after is None:
            problems.append(f"message {name[1:]} removed")
            continue
        assert isinstance(after, descriptor_pb2.DescriptorProto)
        fields = {f.number: f for f in after.field}
        for field in before.field:
            now = fields.get(field.number)
            where = f"{name[1:]} field {field.number} ({field.name})"
            if now is None:
                if not _reserved(after, field.number, field.name):
                    problems.append(f"{where} removed without reserving its number and name")
                continue
            if now.name != field.name or now.json_name != field.json_name:
                problems.append(f"{where} renamed to {now.name}")
            if now.type != field.type or now.type_name != field.type_name:
                problems.append(f"{where} changed type")
            if now.label != field.label:
                problems.append(f"{where} changed label (repeated/optional)")
            if now.proto3_optional != field.proto3_optional:
                problems.append(f"{where} changed presence (proto3 optional)")
            was_in = (
                before.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else ""
            )
            is_in = after.oneof_decl[now.oneof_index].name if now.HasField("oneof_index") else ""
            if was_in != is_in:
                problems.append(f"{where} moved between oneofs ({was_in or '-'} -> {is_in or '-'})")
    for name, before in old_enums.items():
        assert isinstance(before, descriptor_pb2.EnumDescriptorProto)
        after = new_enums.get(name)
        if after is None:
            problems.append(f"enum {name[1:]} removed")
            continue
        assert isinstance(after, descriptor_pb2.EnumDescriptorProto)
        values = {v.number: v.name for v in after.value}
        for value in before.value:
            if value.number not in values:
                problems.append(f"enum {name[1:]} value {value.number} ({value.name}) removed")
            elif values[value.number] != value.name:
                problems.append(
                    f"enum {name[1:]} value {value.number} renamed "
                    f"{value.name} -> {values[value.number]}"
                )
    for name, before in old_services.items():
        assert isinstance(before, descriptor_pb2.ServiceDescriptorProto)
        after = new_services.get(name)
        if after is None:
            problems.append(f"service {name[1:]} removed")
            continue
        assert isinstance(after, descriptor_pb2.ServiceDescriptorProto)
        methods = {m.name: m for m in after.method}
        for method in before.method:
            new_method = methods.get(method.name)
            where = f"{name[1:]}.{method.name}"
            if new_method is None:
                problems.append(f"method {where} removed")
                continue
            types = (new_method.input_type, new_method.output_type)
            if types != (method.input_type, method.output_type):
                problems.append(f"method {where} changed its request or response type")
            if (new_method.client_streaming, new_method.server_streaming) != (
                method.client_streaming,
                method.server_streaming,
            ):
                problems.append(f"method {where} changed streaming")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["check", "snapshot"])
    args = parser.parse_args()
    current = compile_public()
    if args.command == "snapshot":
        RELEASED_SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        RELEASED_SNAPSHOT.write_text(_SNAPSHOT_HEADER + text_format.MessageToString(current))
        print(f"public-protos: wrote {RELEASED_SNAPSHOT.relative_to(ROOT)}")
        return 0
    problems = breaking_changes(load_snapshot(), current)
    if problems:
        print(
            "public-protos: breaking changes against the last release "
            f"({RELEASED_SNAPSHOT.relative_to(ROOT)}):",
            file=sys.stderr,
        )
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        print(
            "Add instead of changing (a new field, method or message), or, for a new major "
            "version, a new package (squall.v2).",
            file=sys.stderr,
        )
        return 1
    print(f"public-protos: {len(PUBLIC_PROTOS)} public files compile alone; no breaking changes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
