"""The coordinator's metrics: its election state, epoch and group, and how often they change.

The driver reports each new view (`CoordinatorObserver.changed`) after applying a Ready
record whose view changed; the counters count transitions from one report to the next,
and the gauges read the election's status on the loop when an exporter collects.

* ``squall.coordinator.state.changes`` — state changes, by the state entered.
* ``squall.coordinator.elections`` — groups this node formed and led to normal as their
  coordinator (one per election cluster-wide: each group has one coordinator).
* ``squall.coordinator.state`` — 1 for the state the node is in, 0 for the others.
* ``squall.coordinator.epoch``, and ``squall.coordinator.group.members`` (the nodes of its
  group while normal, 0 otherwise).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from opentelemetry import metrics

from squall_server.common.telemetry import Telemetry, on_loop
from squall_server.coordinator.messages import ElectionStatus, NodeState

if TYPE_CHECKING:
    from squall_server.coordinator.node import CoordinatorNode


class CoordinatorInstruments:
    """Every coordinator metric, made once per Telemetry; nodes register for the gauges."""

    def __init__(self, telemetry: Telemetry) -> None:
        meter = telemetry.meter
        self.state_changes = meter.create_counter(
            "squall.coordinator.state.changes",
            unit="{change}",
            description="Election state changes of this coordinator, by the state entered",
        )
        self.elections = meter.create_counter(
            "squall.coordinator.elections",
            unit="{election}",
            description="Groups this node formed and led to normal as their coordinator",
        )
        self._sources: dict[int, tuple[Callable[[], ElectionStatus], asyncio.AbstractEventLoop]]
        self._sources = {}
        meter.create_observable_gauge(
            "squall.coordinator.state",
            callbacks=[self._observe_state],
            description="1 for the election state this coordinator is in, 0 for the others",
        )
        meter.create_observable_gauge(
            "squall.coordinator.epoch",
            callbacks=[self._observe_epoch],
            description="The epoch of this coordinator's group",
        )
        meter.create_observable_gauge(
            "squall.coordinator.group.members",
            callbacks=[self._observe_members],
            unit="{node}",
            description="Nodes in this node's group while it is normal, itself included (0 "
            "otherwise)",
        )
        meter.create_observable_gauge(
            "squall.coordinator.config.refused",
            callbacks=[self._observe_refused],
            unit="{node}",
            description="Nodes this coordinator refuses because settings every member must "
            "share differ from its own",
        )

    def watch(self, node: CoordinatorNode) -> None:
        """Reports node's status in the gauges (call on its loop)."""
        self._sources[id(node)] = (node.status, asyncio.get_running_loop())

    def unwatch(self, node: CoordinatorNode) -> None:
        """Stops reporting node."""
        self._sources.pop(id(node), None)

    def _statuses(self) -> list[ElectionStatus]:
        out = []
        for status, loop in list(self._sources.values()):
            reading = on_loop(loop, status)
            if reading is not None:
                out.append(reading)
        return out

    def _observe_state(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for status in self._statuses():
            for state in NodeState:
                yield metrics.Observation(
                    int(status.state is state), {"node": status.node_id, "state": state.value}
                )

    def _observe_epoch(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(s.epoch, {"node": s.node_id}) for s in self._statuses()]

    def _observe_members(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(len(s.members), {"node": s.node_id}) for s in self._statuses()]

    def _observe_refused(self, _: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [
            metrics.Observation(len({m.node_id for m in s.config_mismatches}), {"node": s.node_id})
            for s in self._statuses()
        ]


class CoordinatorObserver:
    """One coordinator's transitions, counted as the driver reports its views."""

    def __init__(self, telemetry: Telemetry, node_id: str) -> None:
        self._instruments = telemetry.instruments("coordinator", CoordinatorInstruments)
        self._attributes = {"node": node_id}
        self._state: NodeState | None = None
        self._led_epoch = 0

    @property
    def instruments(self) -> CoordinatorInstruments:
        """The shared instruments."""
        return self._instruments

    def changed(self, status: ElectionStatus) -> None:
        """The view changed: count a new state, and an election this node won."""
        if status.state is not self._state:
            self._state = status.state
            self._instruments.state_changes.add(
                1, {**self._attributes, "state": status.state.value}
            )
        if (
            status.state is NodeState.NORMAL
            and status.coordinator_id == status.node_id
            and status.epoch > self._led_epoch
        ):
            self._led_epoch = status.epoch
            self._instruments.elections.add(1, self._attributes)
