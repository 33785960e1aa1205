"""Describes the machine a benchmark ran on, so a figure is never read without its hardware.

Everything here is cheap and best effort: a fact that cannot be found (no /proc, no
block device behind a container's filesystem) is reported as None, never guessed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

# The packages whose versions change the figures most.
_PACKAGES = ("grpcio", "protobuf", "lmdb")


def describe(data_dir: Path | None = None) -> dict[str, Any]:
    """The machine, the Python and the libraries, plus the disk behind data_dir if known."""
    cpu = _cpuinfo()
    return {
        "hostname": platform.node(),
        "cpu_model": cpu.get("model name"),
        "cpu_mhz": _float(cpu.get("cpu MHz")),
        "cpu_cores_online": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "virtualized": "hypervisor" in cpu.get("flags", "").split(),
        "memory_bytes": _memory_bytes(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "python_executable": sys.executable,
        "packages": {name: _version(name) for name in _PACKAGES},
        "disk": _disk(data_dir) if data_dir is not None else None,
        "load_average": load_average(),
        "git": git_commit(),
    }


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (runnable processes; 2.0 fills 2 cores)."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def git_commit(repo: Path | None = None) -> dict[str, Any] | None:
    """The commit the code was measured at, and whether tracked files differed from it."""
    where = repo or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # not a checkout (an sdist, a copied tree) or no git
    return {"commit": head, "dirty": bool(changes.strip())}


def summary(machine: dict[str, Any]) -> str:
    """One line for the console and README: cpu, cores, memory, python, disk."""
    memory = machine.get("memory_bytes")
    memory_text = f"{memory / 2**30:.0f} GiB" if memory else "? GiB"
    disk = machine.get("disk") or {}
    disk_text = disk.get("kind") or "disk ?"
    if disk.get("filesystem"):
        disk_text += f" ({disk['filesystem']})"
    if disk.get("fsync_ms_p50") is not None:
        disk_text += f", fsync {disk['fsync_ms_p50']} ms"
    packages = machine.get("packages", {})
    return (
        f"{machine.get('cpu_model') or 'unknown cpu'}, {machine.get('cpu_cores_usable')} cores"
        f"{' (VM)' if machine.get('virtualized') else ''}, {memory_text}, "
        f"{machine.get('python')}, grpcio {packages.get('grpcio')}, lmdb {packages.get('lmdb')}, "
        f"{machine.get('kernel')}, {disk_text}"
    )


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _disk(path: Path) -> dict[str, Any]:
    """The filesystem holding path and, when it is a block device, whether it spins."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    result: dict[str, Any] = {
        "path": str(path),
        "filesystem": None,
        "device": None,
        "rotational": None,
        "kind": None,
    }
    result["filesystem"], result["device"] = _mount_of(path)
    st_dev = os.stat(path).st_dev
    block = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    try:
        uevent = dict(
            line.split("=", 1)
            for line in (block / "uevent").read_text().splitlines()
            if "=" in line
        )
        result["device"] = uevent.get("DEVNAME", result["device"])
        # A partition has no queue of its own: its parent's tells the device type.
        queue = block / "queue" if (block / "queue").exists() else block.resolve().parent / "queue"
        rotational = (queue / "rotational").read_text().strip() == "1"
        result["rotational"] = rotational
        if str(result["device"]).startswith(("vd", "xvd")):
            # Virtual disks report a rotational flag that says nothing about what backs them.
            result["kind"] = "virtual disk"
        else:
            result["kind"] = "rotational (HDD)" if rotational else "non-rotational (SSD)"
    except OSError:
        pass  # no block device (tmpfs, overlay, network): the filesystem type says enough
    result["fsync_ms_p50"] = fsync_ms_p50(path)
    return result


def fsync_ms_p50(directory: Path, rounds: int = 50, budget_s: float = 2.0) -> float | None:
    """Median time to write 4 KiB and fsync it in directory: what SYNC pays per commit."""
    probe = directory / f".fsync-probe-{os.getpid()}"
    times_s: list[float] = []
    try:
        with open(probe, "wb") as file:
            deadline = time.monotonic() + budget_s
            for _ in range(rounds):
                if time.monotonic() > deadline:
                    break
                started = time.perf_counter()
                file.write(b"\0" * 4096)
                file.flush()
                os.fsync(file.fileno())
                times_s.append(time.perf_counter() - started)
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)
    times_s.sort()
    return round(1000 * times_s[len(times_s) // 2], 3) if times_s else None


def _mount_of(path: Path) -> tuple[str | None, str | None]:
    """(filesystem type, source) of the longest mount point containing path."""
    best: tuple[int, str | None, str | None] = (-1, None, None)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        source, mount_point, fs_type = parts[0], parts[1], parts[2]
        inside = str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best[0]:
            best = (len(mount_point), fs_type, source)
    return best[1], best[2]
