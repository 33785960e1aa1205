import pytest


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
