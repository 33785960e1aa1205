"""One clock: every time read in ``services/`` goes through the injected clock
(``services/common/clock.py``, whose ``SystemClock`` is the only reader of the OS clocks), so
the tests and the simulator can drive time and a timeout is never measured two ways.

A static scan (``ast``) of every module under ``services/`` for calls that read a clock:
``time.time`` / ``monotonic`` / ``perf_counter`` / ``process_time`` (and their ``_ns``
forms, also when imported by name), ``datetime.now`` / ``utcnow`` / ``today`` and an event
loop's ``time()``. Sleeping and ``asyncio.timeout`` are not reads (the loop keeps those
deadlines). The exceptions below are listed with their reason; an entry that no longer
matches anything fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
CLOCK_MODULE = SERVICES / "common" / "clock.py"
TIME_FUNCTIONS = {
    "time",
    "time_ns",
    "monotonic",
    "monotonic_ns",
    "perf_counter",
    "perf_counter_ns",
    "process_time",
    "process_time_ns",
}
DATETIME_FUNCTIONS = {"now", "utcnow", "today"}

# (path under services/, what it reads) -> why it may read the OS clock itself.
EXCEPTIONS: dict[tuple[str, str], str] = {
    (
        "common/dev_certs.py",
        "datetime.now",
    ): "a certificate's validity is real calendar time by definition (X.509 notBefore/"
    "notAfter), for development certificates made before any service runs",
    (
        "cli/status_wait.py",
        "time.monotonic",
    ): "the operator's `squall status --wait` command (a CLI process, not a service): its "
    "deadline bounds a human's wait, not a service's timeout",
    (
        "cli/admin.py",
        "time.monotonic",
    ): "the `squall transfer` CLI command's deadline and reported duration (as status_wait.py)",
    (
        "cli/membership.py",
        "time.monotonic",
    ): "the `squall cluster add-node` (and kin) CLI commands' --wait deadline (as status_wait.py)",
    (
        "gateway/shared_publish.py",
        "loop.time",
    ): "a caller's gRPC deadline turned into the asyncio.timeout_at deadline it is waited "
    "with, which asyncio measures on the loop's own clock by definition",
}


def _reads(path: Path) -> list[tuple[int, str]]:
    """The clock reads in one module: (line, what)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    by_name: dict[str, str] = {}  # `from time import monotonic` -> monotonic: time.monotonic
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            for alias in node.names:
                if alias.name in TIME_FUNCTIONS:
                    by_name[alias.asname or alias.name] = f"time.{alias.name}"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in by_name:
            found.append((node.lineno, by_name[func.id]))
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value
        if isinstance(owner, ast.Name) and owner.id == "time" and func.attr in TIME_FUNCTIONS:
            found.append((node.lineno, f"time.{func.attr}"))
        elif func.attr in DATETIME_FUNCTIONS and (
            (isinstance(owner, ast.Name) and owner.id in ("datetime", "date"))
            or (isinstance(owner, ast.Attribute) and owner.attr in ("datetime", "date"))
        ):
            found.append((node.lineno, f"datetime.{func.attr}"))
        elif func.attr == "time" and not node.args and _is_loop(owner):
            found.append((node.lineno, "loop.time"))
    return found


def _is_loop(owner: ast.expr) -> bool:
    """`loop.time()`, `self._loop.time()`, `asyncio.get_running_loop().time()` ..."""
    if isinstance(owner, ast.Name):
        return "loop" in owner.id
    if isinstance(owner, ast.Attribute):
        return "loop" in owner.attr
    if isinstance(owner, ast.Call):
        inner = owner.func
        name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
        return "loop" in name
    return False


def test_only_the_clock_module_reads_the_os_clocks() -> None:
    offenders: list[str] = []
    used: set[tuple[str, str]] = set()
    for path in sorted(SERVICES.rglob("*.py")):
        if path == CLOCK_MODULE:
            continue
        relative = path.relative_to(SERVICES).as_posix()
        for line, what in _reads(path):
            if (relative, what) in EXCEPTIONS:
                used.add((relative, what))
                continue
            offenders.append(f"services/{relative}:{line}: {what}()")
    assert not offenders, (
        "read time through the injected clock (services/common/clock.py), or list the "
        "exception with its reason in this test:\n" + "\n".join(offenders)
    )
    stale = sorted(set(EXCEPTIONS) - used)
    assert not stale, f"exceptions that match nothing any more (remove them): {stale}"


def test_the_scan_finds_each_kind_of_read(tmp_path: Path) -> None:
    """The scan itself works on each form it looks for."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import time, asyncio, datetime\n"
        "from time import perf_counter as pc\n"
        "a = time.monotonic()\n"
        "b = pc()\n"
        "c = datetime.datetime.now()\n"
        "d = asyncio.get_running_loop().time()\n"
        "e = self_loop.time()\n"
        "await asyncio.sleep(1)\n"
    )
    kinds = sorted(what for _, what in _reads(sample))
    assert kinds == [
        "datetime.now",
        "loop.time",
        "loop.time",
        "time.monotonic",
        "time.perf_counter",
    ]
