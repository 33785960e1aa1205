"""Stage timestamps of publishes and deliveries for the latency budget, off unless asked for.

With ``SQUALL_STAGE_TIMINGS_DIR`` set in a process's environment, every `mark` appends a
``stage key monotonic_ns`` line to ``<dir>/<pid>.stages`` (buffered: written when 512 lines
are waiting, 0.2 s after the first one waits on an event loop, or on `flush`). Without
it, `ENABLED` is False and callers skip marking altogether, so the hot path pays one
attribute test. ``CLOCK_MONOTONIC`` is one clock for the whole machine on Linux, so marks
from the client, the gateway and every replica on one host compare directly
(`bench/latency.py` joins them into the per-stage budget).

Keys: a publish request is ``<publisher id>/<first sequence>`` (`request_key`); a log
entry is ``lsn/<lsn>`` on whichever replica marks it; a stored event is
``off/<topic>/<offset>``. `link` records a pair of keys of one write (a request and its
LSN or offset) in the same file.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

__all__ = ["ENABLED", "configure", "flush", "link", "mark", "request_key"]

_DIR = os.environ.get("SQUALL_STAGE_TIMINGS_DIR", "")
ENABLED = bool(_DIR)

# Lines waiting to be written; written at this many, or this long after the first.
_FLUSH_LINES = 512
_FLUSH_AFTER_S = 0.2

_lines: list[str] = []
_lock = threading.Lock()
_scheduled = False


def configure(directory: str) -> None:
    """Turns marking on (a directory) or off (""), for a process that sets it itself."""
    global _DIR, ENABLED
    flush()
    _DIR = directory
    ENABLED = bool(directory)


def request_key(publisher_id: str, first_sequence: int) -> str:
    """The key of one publish request."""
    return f"{publisher_id}/{first_sequence}"


def mark(stage: str, key: str) -> None:
    """Records that `key` reached `stage` now (callers test `ENABLED` first)."""
    line = f"{stage} {key} {time.monotonic_ns()}\n"
    with _lock:
        _lines.append(line)
    _after_append()


def link(key: str, other: str) -> None:
    """Records that two keys name one write (a request and its LSN, say)."""
    with _lock:
        _lines.append(f"= {key} {other}\n")
    _after_append()


def _after_append() -> None:
    global _scheduled
    if len(_lines) >= _FLUSH_LINES:
        flush()
        return
    if _scheduled:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # a thread without a loop: written by size or by an explicit flush
    _scheduled = True
    loop.call_later(_FLUSH_AFTER_S, flush)


def flush() -> None:
    """Writes the waiting lines to this process's file."""
    global _lines, _scheduled
    with _lock:
        _scheduled = False
        lines, _lines = _lines, []
        if not lines or not _DIR:
            return
        try:
            with open(os.path.join(_DIR, f"{os.getpid()}.stages"), "a", encoding="ascii") as out:
                out.writelines(lines)
        except OSError:
            pass  # a measurement aid: losing marks must never fail a publish
