"""A client in a second language, built from the public protos alone, through a gateway.

Goal: an app in any language compiles protos/squall/v1's public files (docs/clients.md),
keeps gRPC's default channel options, and publishes and reads back — including events
whose responses would pass gRPC's default 4 MiB receive limit if the server did not keep
its default responses under it. A reader that goes away mid-stream is an INFO line in the
gateway's log, not an error with a traceback. Node with @grpc/grpc-js
(clients/node/roundtrip.js); `make test` installs its packages into clients/node.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.public_protos import copy_public_protos
from tests.integration.conftest import ROOT, LocalCluster, wait_for
from tests.requirements import node_missing

pytestmark = pytest.mark.integration

NODE_CLIENT = ROOT / "clients" / "node"


def _node() -> str:
    missing = node_missing(NODE_CLIENT)
    if missing is not None:
        pytest.skip(missing)
    node = shutil.which("node")
    assert node is not None
    return node


def _roundtrip(
    node: str, protos: Path, gateway: str, topic: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            node,
            "roundtrip.js",
            "--gateway",
            gateway,
            "--protos",
            str(protos),
            "--topic",
            topic,
            *extra,
        ],
        cwd=NODE_CLIENT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def single(cluster_factory: object) -> LocalCluster:
    """One node and its gateway; its coordinator waits longer for a replica busy with 5 MB
    batches on a loaded machine than the default replica_timeout_ms (300)."""
    cluster = cluster_factory(timeouts={"replica_timeout_ms": 5000})  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    return cluster


def test_node_client_from_public_protos_publishes_and_reads_back(
    single: LocalCluster, tmp_path: Path
) -> None:
    node = _node()
    protos = copy_public_protos(tmp_path / "protos")  # nothing internal is there to import
    done = _roundtrip(node, protos, single.gateway_address, "node-t")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["offsets"] == ["0", "1", "2"]  # uint64 arrives as a decimal string
    assert int(seen["epoch"]) >= 1
    assert seen["duplicates"] == [True, True, True]  # the retry stored nothing new
    assert seen["big_offsets"] == ["3", "4", "5", "6", "7"]
    assert seen["payloads"] == ["hello 1", "hello 2", "hello 3"]
    # Five 1 MB events read back whole with default channel options (4 MiB receive limit).
    assert seen["read_offsets"] == ["3", "4", "5", "6", "7"]
    assert seen["big_sizes"] == [1_000_000] * 5
    assert seen["big_first_bytes"] == [65, 66, 67, 68, 69]
    assert seen["largest_response_payload_bytes"] < 4 * 1024 * 1024
    assert seen["master_id"] == "n1" and int(seen["status_epoch"]) >= 1

    # A reader that asks for more per response than its channel takes fails and goes away
    # mid-stream: the gateway logs one INFO line for it, no ERROR and no traceback.
    gone = _roundtrip(node, protos, single.gateway_address, "node-t", "--ask-bytes", "16000000")
    assert gone.returncode == 2, gone.stdout + gone.stderr
    assert "code 8" in gone.stderr  # RESOURCE_EXHAUSTED
    gateway = single.config.gateways[0].id
    gone_line = "client went away mid-stream"
    # grpcio reports the stream only when its write failed before it saw the cancel (the
    # case that used to be an ERROR with a traceback); give the log a moment either way.
    try:
        wait_for(lambda: gone_line in single.log("gateway", gateway), 5, "the INFO line")
    except AssertionError:
        pass
    log = single.log("gateway", gateway)
    for line in log.splitlines():
        if gone_line in line:
            assert " INFO " in line and "Subscriber/Subscribe" in line, line
    assert "ExecuteBatchError" not in log and "Traceback" not in log, log
    assert " ERROR " not in log, log
