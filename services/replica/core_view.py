"""What the replica's shell parts read of its core and driver, under one set of names.

The node and its parts (the writer, truncation, the slave side, taking the master role)
each hold the same ``ReplicaCore`` and ``ReplicaDriver``; the role, epoch, store, commit
gate and log bounds they read are the core's and the driver's, named once here.
"""

from __future__ import annotations

from squall.v1 import common_pb2
from squall_server.replica.core import ReplicaCore
from squall_server.replica.driver import ReplicaDriver
from squall_server.replica.store import Store
from squall_server.replica.visibility import CommitGate


class CoreView:
    """Read-through properties over ``core`` and ``driver`` (set by the subclass)."""

    core: ReplicaCore
    driver: ReplicaDriver

    @property
    def store(self) -> Store:
        """The store (replaced whole when a truncation installs a rebuilt one)."""
        return self.driver.store

    @store.setter
    def store(self, store: Store) -> None:
        self.driver.store = store

    @property
    def gate(self) -> CommitGate:
        """Committed reads: what a subscriber may see."""
        return self.driver.gate

    @gate.setter
    def gate(self, gate: CommitGate) -> None:
        self.driver.gate = gate

    @property
    def role(self) -> common_pb2.Role.ValueType:
        """The role this replica holds."""
        return common_pb2.Role.ValueType(int(self.core.role))

    @property
    def epoch(self) -> int:
        """The epoch this replica is in (holds, or is taking, a role of)."""
        return self.core.epoch

    @property
    def _last_lsn(self) -> int:
        """The log's last LSN (the core keeps it)."""
        return self.core.log.last_lsn

    @property
    def _log_start_lsn(self) -> int:
        """The first LSN still in the log (the core keeps it)."""
        return self.core.log.log_start_lsn
