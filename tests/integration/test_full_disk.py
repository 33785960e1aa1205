"""A node whose disk fills up, on real processes: what users' machines do.

Goal: the master's filesystem (a small tmpfs mounted over its data directory) fills up
while apps publish. Its replica fail-stops with a log line and a fault that say the
filesystem is full and the store is sound, not the "Input/output error" LMDB reports for
a short write; its coordinator, which cannot save the quarantine that fault asks for,
fail-stops and exits 1 rather than act on a state it did not save. Another node takes
over and publishing goes on. The operator frees space and starts both processes again,
as docs/operations.md ('A full disk') says: the node rejoins with its own store, and
every acknowledged event is on every replica at its offset.

Needs root (a mount); skipped with one line otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from squall.v1 import broker_pb2, broker_pb2_grpc
from tests.integration.conftest import LocalCluster, run_squall, wait_for
from tests.integration.test_replication import (
    _all_three_in_one_group,
    _call_with_retry,
    _Publisher,
    _stop_and_check_every_replica,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("mount") is None,
        reason="a full disk is a small tmpfs over a data directory: needs root and mount",
    ),
]

# Room for the store and the coordinator's state before the test fills the rest.
_FILESYSTEM_SIZE = "32m"
# The filler is written in chunks until the filesystem refuses one (bounded by its size).
_CHUNK_BYTES = 1 << 16


@pytest.fixture
def small_filesystem() -> Iterator[Callable[[Path], None]]:
    """Mounts a tmpfs of _FILESYSTEM_SIZE over a directory; unmounted at teardown, after
    the cluster's processes (requested after this fixture) were stopped."""
    mounted: list[Path] = []

    def mount(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={_FILESYSTEM_SIZE},mode=0700", "tmpfs", path],
            check=True,
        )
        mounted.append(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", path], check=False)


def _fill(directory: Path) -> Path:
    """Writes a file into directory until its filesystem has no room left (unbuffered:
    the last, short write and the refusal after it are the filesystem's, not a flush's)."""
    filler = directory / "filler"
    room = os.statvfs(directory)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(room.f_blocks * room.f_frsize // _CHUNK_BYTES + 2):
            try:
                os.write(fd, b"\0" * _CHUNK_BYTES)
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


def test_a_master_whose_disk_fills_up_fails_over_says_why_and_rejoins_once_space_is_freed(
    small_filesystem: Callable[[Path], None],
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    trio = cluster_factory("cluster.example.toml")
    data_dir = trio.config.node("n1").data_dir
    small_filesystem(data_dir)
    trio.start_all()
    assert trio.wait_for_master() == "n1"
    config = str(trio.config_path)
    with trio.channel() as channel:
        _call_with_retry(
            broker_pb2_grpc.TopicManagerStub(channel).CreateTopic,
            broker_pb2.CreateTopicRequest(name="full"),
            deadline_s=10,
        )
    publishers = [_Publisher(trio.gateway_address, "full", f"full{i}") for i in range(2)]
    try:
        for publisher in publishers:
            publisher.start()

        def acked() -> int:
            return sum(p.count() for p in publishers)

        wait_for(lambda: acked() >= 50, 30, "50 events acknowledged before the disk fills")
        filler = _fill(data_dir)
        wait_for(lambda: "FAIL-STOP" in trio.log("replica", "n1"), 60, "n1 fail-stops")
        stopped = [line for line in trio.log("replica", "n1").splitlines() if "FAIL-STOP" in line]
        assert f"the filesystem holding {data_dir} is full" in stopped[0], stopped[0]
        assert "the store is sound" in stopped[0] and "'A full disk'" in stopped[0]
        assert trio.wait_for_master(60, exclude="n1") != "n1"
        at_failover = acked()
        wait_for(lambda: acked() >= at_failover + 50, 30, "publishing goes on without n1")

        # n1's coordinator could not save the quarantine the replica's fault asked for:
        # it fail-stopped too (exit status 1), rather than act on a state it did not save.
        coordinator = trio.services[("coordinator", "n1")].process
        wait_for(lambda: coordinator.poll() is not None, 30, "n1's coordinator exits")
        assert coordinator.returncode == 1
        said = trio.log("coordinator", "n1")
        assert "FAIL-STOP: saving its state failed" in said and "No space left on device" in said
        assert not list(data_dir.glob("*.tmp")), "a half-written state file left behind"

        status = run_squall("status", "--config", config)
        assert status.returncode == 0, status.stderr
        assert "n1: its replica reports a fault" in status.stdout, status.stdout
        assert f"the filesystem holding {data_dir} is full" in status.stdout, status.stdout

        # The operator's remedy: room, then both processes started again; the store stays.
        filler.unlink()
        trio.stop("replica", "n1")
        trio.start_node("n1")
        _all_three_in_one_group(trio)
        rejoined = acked()
        wait_for(lambda: acked() >= rejoined + 50, 30, "publishing after n1 rejoined")
        _stop_and_check_every_replica(trio, publishers, "full")
    finally:
        for publisher in publishers:
            publisher.stop.set()
        for publisher in publishers:
            publisher.join(timeout=30)
