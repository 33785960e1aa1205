"""`make run` / `make stop` (deploy/launcher.py) with real processes.

Goal: one command brings up three coordinators, three replicas and a gateway as separate
processes with a log each, prints the status table and runs the demo; `make stop` shuts
the cluster down cleanly (every store clean, so the next start needs no operator) and
stops every process by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """The launcher's working directory; whatever it started is killed by PID at the end."""
    yield tmp_path
    pids = tmp_path / ".run" / "pids.json"
    if pids.exists():
        for entry in json.loads(pids.read_text()):
            if _alive(int(entry["pid"])):
                os.kill(int(entry["pid"]), signal.SIGKILL)


def _launcher(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.launcher", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_run_starts_every_service_shows_status_runs_the_demo_and_stop_is_clean(
    workdir: Path,
) -> None:
    config = str(ROOT / "deploy" / "cluster.example.toml")
    # --free-ports: tests run side by side; the default port is kept by `make run` only.
    started = _launcher(workdir, "start", "--config", config, "--demo", "--free-ports")
    assert started.returncode == 0, started.stdout + started.stderr
    out = started.stdout
    entries = json.loads((workdir / ".run" / "pids.json").read_text())
    kinds = sorted((e["kind"], e["name"]) for e in entries)
    assert kinds == [
        ("coordinator", "n1"),
        ("coordinator", "n2"),
        ("coordinator", "n3"),
        ("gateway", "g1"),
        ("replica", "n1"),
        ("replica", "n2"),
        ("replica", "n3"),
    ]
    assert len({e["pid"] for e in entries}) == 7 and all(_alive(e["pid"]) for e in entries)
    for kind, name in kinds:
        log = workdir / ".run" / "logs" / f"{kind}-{name}.log"
        assert f"log .run/logs/{kind}-{name}.log" in out
        assert log.read_text().strip(), f"{log} is empty"
    assert "master elected: n1" in out
    assert "id  prio  coord  group name" in out and "master: n1" in out
    assert "demo: published offset=4" in out and "payload=hello 4" in out

    stopped = _launcher(workdir, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    for node in ("n1", "n2", "n3"):
        assert f"  {node}: clean" in stopped.stdout, stopped.stdout
    assert not any(_alive(e["pid"]) for e in entries)
    assert not (workdir / ".run" / "pids.json").exists()
