"""``make test``'s scheduling of the in-process tests (``tests/xdist_units.py``): a file
runs on one worker, but the chunks of a simulator's seeds run on both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.xdist_units import is_seed_chunk, seed_chunk_id

REPO = Path(__file__).resolve().parents[2]

_CONFTEST = """
import pytest

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from tests.xdist_units import make_scheduler
    return make_scheduler(config, log)
"""

_TESTS = """
import json, os, time
import pytest
from tests.xdist_units import seed_chunk_id

def _record(name):
    with open(os.environ["WORKERS_LOG"], "a") as log:
        log.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER", "")]) + "\\n")

@pytest.mark.parametrize("seeds", [[0, 1], [2, 3], [4, 5], [6, 7]], ids=seed_chunk_id)
def test_chunk(seeds):
    time.sleep(0.2)
    _record(f"chunk{seeds[0]}")

@pytest.mark.parametrize("n", range(4))
def test_plain(n):
    time.sleep(0.1)
    _record(f"{__name__}:plain{n}")
"""


def test_seed_chunk_ids_name_their_seeds() -> None:
    assert seed_chunk_id([100, 101, 149]) == "seeds-100-149"
    assert is_seed_chunk("tests/sim/test_x.py::test_y[seeds-0-49]")
    assert not is_seed_chunk("tests/sim/test_x.py::test_y[3]")
    assert not is_seed_chunk("tests/unit/test_seeds.py::test_seeds-1")


def test_seed_chunks_spread_over_both_workers_and_a_file_stays_on_one(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_units.py").write_text(_TESTS)
    (tmp_path / "test_plain.py").write_text(_TESTS.replace("def test_chunk", "def _no_chunk"))
    log = tmp_path / "workers.jsonl"
    env = {**os.environ, "WORKERS_LOG": str(log), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadfile", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 4 + 4 + 4
    chunk_workers = {worker for name, worker in runs if name.startswith("chunk")}
    assert len(chunk_workers) == 2, runs  # the chunks of one file ran on both workers
    for module in ("test_units", "test_plain"):  # a file's other tests: one worker
        workers = {worker for name, worker in runs if name.startswith(f"{module}:")}
        assert len(workers) == 1, runs
