"""One Squall cluster and one SparkSession shared by every Spark test (JVM start-up is slow).

The session runs in local[2,2] mode: two task slots, and a failed task is tried twice
(plain local[N] never retries, which the exactly-once tests need). Spark's Python workers
are started by the JVM, so they get this interpreter (PYSPARK_PYTHON) and the repository
root on PYTHONPATH, to import the test-only data source in tests/spark/flaky.py.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import ROOT, LocalCluster, make_cluster

pytest.importorskip(
    "pyspark", reason="the spark extra is not installed (pip install -e './clients[spark]')"
)

import squall
from squall.spark import local_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Where the flaky test writer leaves its markers (read by the workers from the environment).
MARKER_DIR_ENV = "SQUALL_SPARK_TEST_DIR"


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running one-node Squall cluster for the whole Spark session; stopped by PID."""
    cluster = make_cluster(
        ROOT / "deploy" / "single.toml", tmp_path_factory.mktemp("spark-cluster")
    )
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """The one SparkSession: local[2,2], loopback, UI off, squall and squall_flaky registered."""
    from tests.requirements import java_missing
    from tests.spark.flaky import FlakySquallDataSource

    missing = java_missing()
    if missing is not None:
        pytest.skip(missing)
    os.environ[MARKER_DIR_ENV] = str(tmp_path_factory.mktemp("spark-markers"))
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    session = local_session("squall-tests", cores=2, task_attempts_max=2)
    session.dataSource.register(FlakySquallDataSource)
    try:
        yield session
    finally:
        session.stop()


_names = itertools.count()


@pytest.fixture
def new_topic(spark_cluster: LocalCluster, request: pytest.FixtureRequest) -> Callable[[], str]:
    """Creates a fresh replicated topic per call, named after the test."""

    def create() -> str:
        name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{request.node.name[:40]}-{next(_names)}")
        with squall.connect(spark_cluster.gateway_address) as client:
            client.create_topic(name)
        return name

    return create


def marker_dir() -> Path:
    """The directory the flaky writer's markers go to."""
    return Path(os.environ[MARKER_DIR_ENV])
