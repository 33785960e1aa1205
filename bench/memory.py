"""Memory of each service process, from /proc/PID/status, for the benchmark report.

`VmRSS` is what a process holds in RAM now; `VmHWM` is the most it has held since it
started (its peak RSS). Both are in kB in the file; we report bytes. Read at idle (a
cluster settled, nothing published) and after load, the difference is what the load left
behind: caches, grown buffers, LMDB pages mapped in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# /proc/PID/status fields we read, and the name each gets in the report.
_FIELDS = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
# Present since Linux 4.5: RSS split into anonymous memory (the Python heap, gRPC's
# buffers) and file-backed pages (for a replica mostly LMDB's memory map, which is page
# cache the kernel can drop, not memory the process allocated).
_OPTIONAL_FIELDS = {"RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes"}


def parse_status(text: str) -> dict[str, int]:
    """rss_bytes, peak_rss_bytes (and rss_anon_bytes, rss_file_bytes if the kernel has
    them) from the text of a /proc/PID/status file."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        name = _FIELDS.get(key.strip()) or _OPTIONAL_FIELDS.get(key.strip())
        if name is None:
            continue
        parts = value.split()
        # The kernel always writes "<number> kB" for these two.
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            found[name] = int(parts[0]) * 1024
    return found


def process_memory(pid: int) -> dict[str, int] | None:
    """A live process's rss_bytes and peak_rss_bytes, or None if it is gone (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = parse_status(text)
    return found if all(name in found for name in _FIELDS.values()) else None


def sample(pids: dict[str, int]) -> dict[str, Any]:
    """Memory of every named process (None for one that is gone)."""
    return {name: process_memory(pid) for name, pid in sorted(pids.items())}
