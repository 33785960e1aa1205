"""`squall status --wait-normal SECONDS`: block until the whole group is back to normal.

What a rolling restart or upgrade waits for between two nodes: every configured node is
reachable and NORMAL in one group and one epoch, one master leads it, every other node is
its slave, and the master streams to each slave with at most ``--max-lag`` entries not
yet acknowledged. Only then is taking the next node down as safe as the cluster's
configuration allows (a node still catching up is not yet a copy the group can count
on).
"""

from __future__ import annotations

import time
from typing import TextIO

import squall

DEFAULT_MAX_LAG_ENTRIES = 1000
_POLL_INTERVAL_S = 0.2


def group_problems(status: squall.ClusterStatus, max_lag_entries: int) -> list[str]:
    """Why the group is not normal yet, one phrase per problem; empty when it is."""
    problems: list[str] = []
    master = status.master_id
    if not master:
        problems.append("no master")
    epochs: set[int] = set()
    for node in status.nodes:
        if not node.reachable:
            problems.append(f"{node.node_id} unreachable ({node.error or 'no answer'})")
            continue
        epochs.add(node.epoch)
        if node.state != "normal":
            problems.append(f"{node.node_id} is {node.state}")
        if master and node.coordinator_id != master:
            problems.append(f"{node.node_id} follows {node.coordinator_id or 'nobody'}")
        expected_role = "master" if node.node_id == master else "slave"
        if node.role != expected_role:
            problems.append(f"{node.node_id}'s replica is {node.role}, not {expected_role}")
    if len(epochs) > 1:
        problems.append(f"nodes in different epochs ({', '.join(map(str, sorted(epochs)))})")
    leader = next((n for n in status.nodes if n.node_id == master and n.reachable), None)
    if leader is not None:
        progress = {slave.node_id: slave for slave in leader.slaves}
        for node in status.nodes:
            if node.node_id == master:
                continue
            slave = progress.get(node.node_id)
            if slave is None:
                problems.append(f"{master} does not replicate to {node.node_id}")
            elif slave.state != "streaming":
                problems.append(f"{node.node_id} is {slave.state}")
            elif slave.lag_entries > max_lag_entries:
                problems.append(f"{node.node_id} lags {slave.lag_entries} entries")
    return problems


def wait_until_normal(
    client: squall.Client, timeout_s: float, max_lag_entries: int, err: TextIO
) -> int:
    """Polls the gateway's status until group_problems is empty: 0, or 1 at the deadline."""
    deadline = time.monotonic() + timeout_s
    problems: list[str] = ["no status yet"]
    while True:
        try:
            problems = group_problems(client.status(), max_lag_entries)
        except squall.SquallError as exc:
            problems = [f"status: {exc}"]
        if not problems:
            return 0
        if time.monotonic() >= deadline:
            print(
                f"squall: the group is not normal after {timeout_s:g}s: {'; '.join(problems)}",
                file=err,
            )
            return 1
        time.sleep(_POLL_INTERVAL_S)
