"""Which replica serves a Subscribe the gateway forwards: the master, or the least loaded
replica of its group (pure: no grpc, no clock).

Any replica serves committed reads (a slave only up to the commit LSN it has learned from
its master, `services/replica/visibility.py`), so spreading readers costs no guarantee;
what it buys is a master that spends its CPU on publishers. The gateway counts the
streams it has open on each replica and sends a new reader to the one with the fewest,
slaves before the master on a tie, then by node id, so a quiet cluster's first readers go
to slaves and a busy one's spread evenly. Writes a reader makes (an Ack, a Seek, creating a
durable subscription) still go to the master: only the stream moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from squall.v1 import broker_pb2

# The initial metadata naming the node a forwarded Subscribe was sent to.
READ_NODE_KEY = "squall-read-node"


@dataclass(frozen=True)
class Replica:
    """A replica the gateway may read from."""

    node_id: str
    address: str


class UnknownReadFrom(ValueError):
    """A Subscribe's `read_from` is a value this gateway does not know (a newer client's)."""


def spreads(read_from: int, gateway_default: str) -> bool:
    """True when a Subscribe asking `read_from` may go to any replica of the group.

    Raises UnknownReadFrom for a value the enum does not name: proto3 enums are open, and
    guessing (the gateway's default) could send a reader somewhere it asked not to go."""
    if read_from == broker_pb2.READ_FROM_REPLICAS:
        return True
    if read_from == broker_pb2.READ_FROM_MASTER:
        return False
    if read_from == broker_pb2.READ_FROM_UNSPECIFIED:
        return gateway_default == "replicas"
    known = ", ".join(f"{name} ({number})" for name, number in broker_pb2.ReadFrom.items())
    raise UnknownReadFrom(
        f"SubscribeRequest.read_from: unknown value {read_from}; this gateway knows {known}"
    )


class ReadSpread:
    """Open forwarded reads per replica, and the choice of the next one."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def open_reads(self, node_id: str) -> int:
        """How many forwarded streams are open on node_id."""
        return self._open.get(node_id, 0)

    def choose(self, members: list[Replica], master_id: str) -> Replica | None:
        """The member with the fewest open reads (slaves first on a tie); None if none."""
        if not members:
            return None
        return min(
            members,
            key=lambda r: (self.open_reads(r.node_id), r.node_id == master_id, r.node_id),
        )

    def opened(self, node_id: str) -> None:
        """A stream to node_id started."""
        self._open[node_id] = self._open.get(node_id, 0) + 1

    def closed(self, node_id: str) -> None:
        """A stream to node_id ended."""
        left = self._open.get(node_id, 0) - 1
        if left > 0:
            self._open[node_id] = left
        else:
            self._open.pop(node_id, None)
