"""A small JSON file written so that a crash or a full disk leaves the old file or the new.

The coordinator's state, the replica's fault record and the loss reports each live in
one such file beside the store: written to a twin, flushed, renamed over the file, and
the directory flushed so the rename survives a power cut. A write that fails (a full
disk, say) removes its half-written twin and raises: the old file stands.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def write_json_durably(path: Path, document: Any) -> None:
    """Replaces path with document as JSON, atomically and durably (OSError otherwise;
    the directory must exist)."""
    temporary = path.with_suffix(".tmp")
    try:
        with open(temporary, "w") as handle:
            json.dump(document, handle, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
