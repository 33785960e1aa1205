"""The pure cores stay pure: no grpc, lmdb, asyncio, threads, clock or randomness inside,
directly or through a module of the project they import (the charter's rule for election and
replication logic, and issue 15's for the replica's role core).

A static scan of import statements (``ast``), following imports of ``services.*`` modules
transitively, so a core cannot become impure by importing a helper that is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The pure state machines and the plain data they share.
PURE_CORES = (
    "squall_server.coordinator.election",
    "squall_server.coordinator.messages",
    "squall_server.replica.core",
    "squall_server.replica.replication",
    "squall_server.replica.follower",
    "squall_server.replica.divergence",
    "squall_server.replica.visibility",
    "squall_server.replica.shared",
    "squall_server.replica.link_rules",
    "squall_server.replica.master_streams",
)
# Top-level packages a pure core must not reach: I/O, event loops, threads, clocks, chance.
BANNED = {
    "asyncio",
    "concurrent",
    "grpc",
    "lmdb",
    "os",
    "random",
    "secrets",
    "selectors",
    "socket",
    "subprocess",
    "threading",
    "time",
    "datetime",
    "uuid",
}


def _imports(module: str) -> set[str]:
    """The modules one project module imports (absolute names)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # "from squall_server.replica import x" may name a module.
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if (ROOT / (candidate.replace(".", "/") + ".py")).exists():
                    found.add(candidate)
    return found


def _reach(module: str) -> dict[str, str]:
    """Every module reachable from `module` through project imports: name -> importer."""
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        current = todo.pop()
        for imported in _imports(current):
            if imported in seen:
                continue
            seen[imported] = current
            if (
                imported.startswith("squall_server.")
                and (ROOT / (imported.replace(".", "/") + ".py")).exists()
            ):
                todo.append(imported)
    return seen


@pytest.mark.parametrize("module", PURE_CORES)
def test_a_pure_core_reaches_no_io_loop_thread_clock_or_randomness(module: str) -> None:
    reached = _reach(module)
    bad = sorted(
        f"{name} (imported by {importer})"
        for name, importer in reached.items()
        if name.split(".")[0] in BANNED
    )
    assert not bad, f"{module} is no longer pure: it reaches {', '.join(bad)}"


def test_the_scan_sees_an_impure_import() -> None:
    """The scan itself works: the replica's driver is (rightly) impure."""
    reached = _reach("squall_server.replica.node")
    assert "asyncio" in reached and "grpc" in reached


# The coordinator's synchronous driver (services/coordinator/driver.py) is not pure (it
# logs, and its FileStateStore writes the state file through persist.py), but the
# simulator runs it on virtual time, so it must reach no event loop, network, thread,
# clock or randomness. It imports the Clock protocol from squall_server.common.clock, whose
# SystemClock alone reads the OS clocks (tests/unit/test_one_clock.py); the driver reads
# only the clock it is given.
DRIVER_BANNED = BANNED - {"os"}


def test_the_coordinator_driver_reaches_no_event_loop_network_clock_or_randomness() -> None:
    reached = _reach("squall_server.coordinator.driver")
    bad = sorted(
        f"{name} (imported by {importer})"
        for name, importer in reached.items()
        if name.split(".")[0] in DRIVER_BANNED and importer != "squall_server.common.clock"
    )
    assert not bad, f"the coordinator driver can no longer run simulated: {', '.join(bad)}"


def test_the_replica_driver_reaches_no_event_loop_network_disk_clock_or_randomness() -> None:
    """The replica's synchronous driver (services/replica/driver.py) is given its store, so
    a simulator can run it over the in-memory twin: it reaches no LMDB either."""
    reached = _reach("squall_server.replica.driver")
    bad = sorted(
        f"{name} (imported by {importer})"
        for name, importer in reached.items()
        if name.split(".")[0] in DRIVER_BANNED
        # seek only formats a stored timestamp for a message; a datetime clock read
        # anywhere in the services is caught by tests/unit/test_one_clock.py.
        and (name, importer) != ("datetime", "squall_server.replica.seek")
    )
    assert not bad, f"the replica driver can no longer run simulated: {', '.join(bad)}"


def test_the_master_steps_reach_no_event_loop_network_disk_clock_or_randomness() -> None:
    """The master's synchronous replication steps (services/replica/master_steps.py) are
    given their store and outputs, so a simulator can run them over the in-memory twin."""
    reached = _reach("squall_server.replica.master_steps")
    bad = sorted(
        f"{name} (imported by {importer})"
        for name, importer in reached.items()
        if name.split(".")[0] in DRIVER_BANNED
        and (name, importer) != ("datetime", "squall_server.replica.seek")
    )
    assert not bad, f"the master steps can no longer run simulated: {', '.join(bad)}"
