"""The example cluster (deploy/cluster.example.toml) for tests that build its nodes in
process: each node's data directory under the test's own directory, made, so what a node
records beside its store (a fault, a loss report) stays with that test. The example's own
directories (`../data/cluster/nX`) are the checkout's, shared by every test run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from squall_server.common.config import ClusterConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "cluster.example.toml"


def example_config(data_root: Path) -> ClusterConfig:
    """The example cluster, each node's data directory under data_root."""
    config = load_config(EXAMPLE)
    nodes = tuple(dataclasses.replace(n, data_dir=data_root / n.id) for n in config.nodes)
    for node in nodes:
        node.data_dir.mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(config, nodes=nodes)
