"""`make bytecode` (scripts/bytecode.py) leaves no module a service imports to be compiled
again at each process start, where PYTHONDONTWRITEBYTECODE keeps Python from caching it."""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path

from scripts import bytecode


def _current_bytecode(source: Path) -> bool:
    """True if the source's cached bytecode exists and was compiled from it as it is."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    try:
        header = cached.read_bytes()[:16]
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags, mtime, size = struct.unpack("<3I", header[4:16])
    stat = source.stat()
    return flags == 0 and mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size


def test_every_module_a_service_imports_has_current_bytecode_after_make_bytecode() -> None:
    assert bytecode.main() == 0
    imported = [Path(name) for name in bytecode.service_imports()]
    assert any(p.parts[-2:] == ("grpc", "__init__.py") for p in imported), imported
    # The standard library's bytecode is the interpreter's install's business.
    stdlib = Path(os.__file__).parent
    missing = [
        str(p) for p in imported if not p.is_relative_to(stdlib) and not _current_bytecode(p)
    ]
    assert missing == [], f"{len(missing)} modules compiled at every start: {missing[:10]}"


def test_the_runtime_closure_holds_what_a_service_needs_and_not_the_tools() -> None:
    names = {dist.metadata["Name"].lower() for dist in bytecode.runtime_closure()}
    assert {"grpcio", "protobuf", "opentelemetry-sdk", "lmdb", "squall"} <= names
    assert not names & {"pyspark", "pytest", "mypy", "ruff", "matplotlib"}
