"""The narrow interfaces the coordinator's side of the replica uses of the node: hand-off
(``handoff``), cluster shutdown (``shutdown``), the ``ReplicaControl`` servicer that
serves both with the role commands and the replica's state, and the metrics sampler
(``telemetry``).

As in ``endpoints.py``, ``ReplicaNode`` (``node.py``) is the one implementation; mypy
checks it where ``__main__`` hands it to ``ReplicaControl`` and where the node registers
with the sampler. The role rules these callers ask the core for directly (the hand-off
fence, the shutdown freeze) are named here too, as the part of ``ReplicaCore`` they use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from squall.v1 import replica_pb2
from squall_server.common.clock import Clock
from squall_server.common.config import ClusterConfig, NodeConfig
from squall_server.common.loss_record import LossRecord
from squall_server.replica.core import Effects, RoleRefusal, WriteFence
from squall_server.replica.endpoints import RoleView
from squall_server.replica.faults import Fault
from squall_server.replica.store import Store

if TYPE_CHECKING:  # (the shells' modules, not needed at run time here)
    from squall_server.replica.master_driver import SlaveStatus
    from squall_server.replica.reorg import Taking


class ReplicaPosition(RoleView, Protocol):
    """Who this replica is and where it stands: its role and epoch, and its log's end and
    commit LSN."""

    @property
    def last_lsn(self) -> int: ...

    @property
    def commit_lsn(self) -> int: ...


class HandoffRules(Protocol):
    """The core's leadership-transfer fence (``ReplicaCore``)."""

    @property
    def fence(self) -> WriteFence: ...

    def fence_writes(self, target: str, epoch: int, until_ms: int) -> RoleRefusal | None: ...

    def lift_fence(self, epoch: int) -> None: ...


class HandoffEndpoint(ReplicaPosition, Protocol):
    """A master's part in a leadership transfer (``handoff.prepare``)."""

    @property
    def config(self) -> ClusterConfig: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def core(self) -> HandoffRules: ...

    def slave_status(self) -> list[SlaveStatus]: ...

    def writes_idle(self) -> bool: ...

    def send_riding_writes(self) -> None: ...

    def commit_signal(self) -> asyncio.Event: ...


class ShutdownRules(Protocol):
    """The core's cluster-shutdown rules (``ReplicaCore``)."""

    def freeze(self, shutdown_id: str, now_ms: int, hold_ms: int) -> Effects: ...

    def finish(self, shutdown_id: str) -> Effects: ...

    def abort(self, shutdown_id: str) -> Effects: ...


class ShutdownEndpoint(ReplicaPosition, Protocol):
    """A replica's part in a clean cluster shutdown (``shutdown``)."""

    @property
    def core(self) -> ShutdownRules: ...

    @property
    def store(self) -> Store: ...

    @property
    def frozen_for(self) -> str: ...

    def freeze_remaining_ms(self) -> int: ...

    @property
    def failed_reason(self) -> str: ...

    @property
    def on_shutdown(self) -> Callable[[], None] | None: ...

    @property
    def clock(self) -> Clock: ...

    async def apply_effects(self, effects: Effects) -> Taking | None: ...

    async def drain_writes(self) -> None: ...

    async def store_write(self, write: Callable[[], None]) -> None: ...


class ControlRules(HandoffRules, ShutdownRules, Protocol):
    """The core's rules ``ReplicaControl``'s callers ask for."""


class ControlEndpoint(HandoffEndpoint, ShutdownEndpoint, Protocol):
    """The ``ReplicaControl`` servicer's: role commands, the replica's state as the
    coordinator reads it, cluster shutdown and hand-off."""

    @property
    def core(self) -> ControlRules: ...

    @property
    def master(self) -> NodeConfig | None: ...

    @property
    def command_seq(self) -> int: ...

    @property
    def log_start_lsn(self) -> int: ...

    @property
    def joined(self) -> bool: ...

    @property
    def fault(self) -> Fault | None: ...

    @property
    def losses(self) -> tuple[LossRecord, ...]: ...

    def store_stalled_ms(self) -> int: ...

    def quorum_silent_ms(self) -> int: ...

    def reorganization_progress(self) -> replica_pb2.ReorganizationProgress | None: ...

    async def apply_role(self, command: replica_pb2.RoleCommand) -> None: ...


class LinkLags(Protocol):
    """Each topic link's backlog (``LinkForwarding.lags``)."""

    def lags(self) -> Iterable[tuple[str, str, int, int]]: ...


class SampledReplica(ReplicaPosition, Protocol):
    """What the metrics sampler reads (``telemetry.sample``)."""

    @property
    def store(self) -> Store: ...

    @property
    def links(self) -> LinkLags: ...

    def slave_status(self) -> list[SlaveStatus]: ...
