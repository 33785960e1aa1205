"""The coordinator's driver and a stuck disk (issue 14: 1): what a role answer's
``store_stalled_ms`` becomes as election input.

Goal: a stall past ``timeouts.store_stall_timeout_ms`` is reported once as a silent replica
(since the stall's start, marked as a stalled store) and takes the node out of its group;
a health probe's answer (which says nothing of the store) does not end it; an answer
whose store writes again does, and the node rejoins. A stall below the timeout (a slow
disk) changes nothing. The real election decides; the driver's outputs are collected
instead of sent (no network).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.common.clock import ManualClock
from services.coordinator.election import Ready
from services.coordinator.node import CoordinatorNode
from tests.observability_harness import cluster_config


def test_a_stalled_store_takes_the_node_out_until_an_answer_says_it_writes(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        config = cluster_config(tmp_path, ["n1", "n2", "n3"])
        assert config.timeouts.store_stall_timeout_ms == 2000
        config.node("n1").data_dir.mkdir(parents=True)
        clock = ManualClock(monotonic_start_ms=10_000)
        node = CoordinatorNode(config, config.node("n1"), clock)
        applied: list[Ready] = []
        node.apply = applied.append  # type: ignore[method-assign]
        events = lambda: [e.event for r in applied for e in r.events]  # noqa: E731
        node.apply(node.election.tick(clock.monotonic_ms()))

        node._replica_answered(1999)  # a slow disk: nothing happens
        assert node.election.status().replica_unreachable_since_ms is None
        assert "replica-store-stalled" not in events()

        node._replica_answered(2500)
        status = node.election.status()
        assert status.replica_unreachable_since_ms is not None
        assert status.last_change_reason.startswith(
            "replica store stalled: no write completed for 2500 ms"
        )
        assert "replica-store-stalled" in events()
        reported = len(applied)

        clock.advance(500)
        node._replica_answered(None)  # a health probe answers: the store still stalls
        node._replica_answered(3000)  # the same stall, longer: reported once
        assert len(applied) == reported
        assert node.election.status().replica_unreachable_since_ms is not None

        clock.advance(500)
        node._replica_answered(0)  # writes complete again
        assert node.election.status().replica_unreachable_since_ms is None
        assert "replica-back" in events()
        back = [e.message for r in applied for e in r.events if e.event == "replica-back"]
        assert "replica store writes complete again after 3500 ms stalled" in back[0]
        await node._replica_channel.close()
        for channel in node._channels.values():
            await channel.close()

    asyncio.run(scenario())
