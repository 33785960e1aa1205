from typing import Any

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` a file per worker at a time, but every chunk of a simulator's
    seeds a unit of its own (``tests/xdist_units.py``)."""
    from tests.xdist_units import make_scheduler

    return make_scheduler(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks everything under tests/integration as integration, under tests/chaos as
    integration and chaos, under tests/spark as spark."""
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
        elif "/chaos/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.chaos)
        elif "/spark/" in str(item.fspath):
            item.add_marker(pytest.mark.spark)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per missing machine requirement (tests/requirements.py): how many tests
    it skipped and what to install, so a skip is never silent."""
    from tests.chromium import CHROMIUM_PREFIX
    from tests.requirements import JAVA_PREFIX, NETNS_PREFIX, NODE_PREFIX

    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if not isinstance(longrepr, tuple) or len(longrepr) != 3:
            continue
        reason = str(longrepr[2]).removeprefix("Skipped: ")
        if reason.startswith((JAVA_PREFIX, NETNS_PREFIX, NODE_PREFIX, CHROMIUM_PREFIX)):
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in sorted(reasons.items()):
        terminalreporter.write_line(f"squall: {count} test(s) skipped: {reason}", yellow=True)
