"""The `squall` command line and the raw-stubs example against a real one-node cluster.

Goal: what the README shows an operator typing works as shown.
"""

from __future__ import annotations

import subprocess
import sys

from tests.integration.conftest import ROOT, LocalCluster


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_topic_publish_subscribe_and_status_commands(shared_single: LocalCluster) -> None:
    gateway = ["--gateway", shared_single.gateway_address]
    created = _run("-m", "squall_server", "topic", "create", "cli-demo", *gateway)
    assert created.returncode == 0, created.stderr
    published = _run("-m", "squall_server", "publish", "cli-demo", *gateway, stdin="one\ntwo\n")
    assert published.returncode == 0, published.stderr
    assert [line.split()[0] for line in published.stdout.splitlines()] == ["offset=0", "offset=1"]
    read = _run("-m", "squall_server", "subscribe", "cli-demo", "--count", "2", *gateway)
    assert read.stdout.splitlines() == ["0\t\tone", "1\t\ttwo"]
    listed = _run(
        "-m", "squall_server", "topic", "list", "--config", str(shared_single.config_path)
    )
    assert "cli-demo" in listed.stdout
    status = _run("-m", "squall_server", "status", *gateway)
    assert status.returncode == 0
    assert "master: n1" in status.stdout
    duplicate = _run("-m", "squall_server", "topic", "create", "cli-demo", *gateway)
    assert duplicate.returncode == 1
    assert duplicate.stderr.startswith("squall: ") and "already exists" in duplicate.stderr


def test_the_raw_stubs_example_runs(shared_single: LocalCluster) -> None:
    done = _run(
        "examples/raw_stubs_app.py", "--gateway", shared_single.gateway_address, "--topic", "raw"
    )
    assert done.returncode == 0, done.stderr
    assert "read 5 events" in done.stdout, done.stdout
