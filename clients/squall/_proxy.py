"""Publisher bindings: where a publisher's streams go, and when it moves to another replica.

A `Publisher` opens each PublishStream on whatever its binding names (IceStorm's
publisher proxy, STYLE.md's small interface with a twin):

* `GatewayBinding` — every stream goes through the gateway, which follows the master
  itself; the binding never moves and is never lost.
* `ProxyBinding(replicated=True)` — the endpoints `GetPublisher` returned (every
  replica, master first). Streams go straight to one endpoint; when a stream to it ends
  in a way that says it may be gone (UNAVAILABLE or another indeterminate code), the next
  stream goes to the next endpoint, round robin. A slave's refusal carrying
  `squall-master-address` sends the next stream to that master instead. A stream whose
  status the asyncio client lost (`STATUS_LOST_KEY`) was ended by the replica itself: the
  next stream goes to it again.
* `ProxyBinding(replicated=False)` — the master only (`GetNonReplicatedPublisher`). No
  silent failover: once that master is lost (an indeterminate end or a redirect), the
  binding is lost for good and the publisher raises `PublisherLost`; the app asks the
  topic for a new publisher.

The binding only decides where; the publisher keeps its retries, ids and sequences.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from squall._errors import PublisherLost, SquallError
from squall.v1 import broker_pb2_grpc
from squall.wire.retry import INDETERMINATE_AFTER_SEND

# The trailing metadata key a slave's write refusal names the master's address under.
MASTER_ADDRESS_KEY = "squall-master-address"
# The request metadata key naming replicas a proxy just failed to reach (comma-separated):
# a replica holds such a call until it can serve it or name another master, instead of
# redirecting it to the dead one (services/replica/server.py `_hold`).
UNREACHABLE_KEY = "squall-unreachable"
# Never on the wire: the trailing metadata an asyncio reader gives a stream whose status
# grpc.aio lost (`squall._publish_rules.status_lost_trailing`). The replica ended the
# stream, so it is up: the next stream goes to it again, and it is not named unreachable.
STATUS_LOST_KEY = "squall-client-status-lost"


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """One replica a publisher proxy may bind to."""

    node_id: str
    address: str


RebindCallback = Callable[[Endpoint, Endpoint], None]


def master_address(trailing: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The master address a slave's refusal names ("" when it names none)."""
    for key, value in trailing or ():
        if key == MASTER_ADDRESS_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


class GatewayBinding:
    """Streams through the gateway's one channel: never moves, never lost."""

    replicated = True

    def __init__(self, stub: broker_pb2_grpc.PublisherStub) -> None:
        self._stub = stub

    def open(self) -> tuple[broker_pb2_grpc.PublisherStub, Endpoint | None]:
        """The stub for the next stream, and the endpoint it is bound to (None: gateway)."""
        return self._stub, None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Request metadata for the next stream: none (the gateway waits for a master)."""
        return ()

    def stream_answered(self, endpoint: Endpoint | None) -> None:
        """A stream got its first answer; nothing to note."""

    def stream_failed(
        self,
        endpoint: Endpoint | None,
        code: grpc.StatusCode,
        trailing: Iterable[tuple[str, str | bytes]] | None,
    ) -> None:
        """The gateway moves between masters itself; nothing to do."""

    def lost_error(self, error: SquallError) -> SquallError | None:
        """Never lost."""
        return None

    def take_redirect(self) -> bool:
        """The gateway follows redirects itself: never one to follow here."""
        return False

    def can_check_master(self) -> bool:
        """The gateway follows the master itself (and ends a stream when it moves)."""
        return False

    def check_master(self, timeout_s: float) -> str:
        """Never asked (see can_check_master)."""
        return ""

    def close(self) -> None:
        """The channel is the client's."""


class ProxyBinding:
    """A publisher proxy's endpoints and which one the next stream uses."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        replicated: bool,
        make_channel: Callable[[str], Any],
        master_of: Callable[[float], str] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a publisher proxy needs at least one endpoint")
        self.replicated = replicated
        # Asks the gateway which replica is master (its address; "" if it cannot say
        # within the timeout given).
        self._master_of = master_of
        self._endpoints = list(endpoints)
        self._make_channel = make_channel
        self._lock = threading.Lock()
        self._index = 0
        # Set by a slave's redirect; used instead of the list until it fails.
        self._redirect: Endpoint | None = None
        # A redirect not yet followed: the next retry goes without a backoff.
        self._redirect_fresh = False
        self._lost: str = ""
        # grpc.Channel, or grpc.aio.Channel for the asyncio client.
        self._channels: dict[str, Any] = {}
        self._closed = False
        # Addresses whose last stream ended indeterminately since a stream last answered.
        self._unreachable: set[str] = set()

    @property
    def endpoints(self) -> list[Endpoint]:
        """The proxy's endpoints, as issued (master first)."""
        return list(self._endpoints)

    def current(self) -> Endpoint:
        """The endpoint the next stream goes to."""
        with self._lock:
            return self._current()

    def _current(self) -> Endpoint:
        return self._redirect or self._endpoints[self._index]

    def target(self) -> Endpoint:
        """The endpoint the next stream (or shared-stream publish) goes to; PublisherLost
        once lost or closed."""
        with self._lock:
            return self._target()

    def _target(self) -> Endpoint:
        if self._lost:
            raise PublisherLost(self._lost_message(), maybe_stored=False)
        if self._closed:
            raise PublisherLost("the publisher proxy is closed", maybe_stored=False)
        return self._current()

    def new_channel(self, address: str) -> Any:
        """A channel to `address` made as this proxy makes its own, for the caller to own
        and close (the client's shared stream to that replica, `squall._publish_mux`)."""
        return self._make_channel(address)

    def open(self) -> tuple[broker_pb2_grpc.PublisherStub, Endpoint | None]:
        """The stub for the next stream and its endpoint; PublisherLost once lost."""
        with self._lock:
            endpoint = self._target()
            channel = self._channels.get(endpoint.address)
            if channel is None:
                channel = self._channels[endpoint.address] = self._make_channel(endpoint.address)
        return broker_pb2_grpc.PublisherStub(channel), endpoint

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Request metadata for the next stream: the replicas just found unreachable."""
        with self._lock:
            if not self._unreachable:
                return ()
            return ((UNREACHABLE_KEY, ",".join(sorted(self._unreachable))),)

    def stream_answered(self, endpoint: Endpoint | None) -> None:
        """A stream answered: the failover is over, and what it found unreachable is stale.

        A replica holds a call naming an unreachable master (see UNREACHABLE_KEY); a mark
        kept from an older failover would make it hold the call for the master that has
        since come back (a restarted node taking the lead back) until its hold times out.
        """
        if endpoint is not None:
            with self._lock:
                self._unreachable.clear()

    def stream_failed(
        self,
        endpoint: Endpoint | None,
        code: grpc.StatusCode,
        trailing: Iterable[tuple[str, str | bytes]] | None,
    ) -> None:
        """Notes how a stream bound to `endpoint` ended, choosing the next endpoint."""
        redirect = master_address(trailing)
        if any(key == STATUS_LOST_KEY for key, _ in trailing or ()):
            return  # the replica answered; its reason is unknown: try it again
        with self._lock:
            if (
                endpoint is not None
                and self.replicated
                and not redirect
                and code.name in INDETERMINATE_AFTER_SEND
            ):
                self._unreachable.add(endpoint.address)
            if endpoint is None or endpoint != self._current() or self._lost:
                return  # an older stream's news; a newer choice stands
            if redirect and redirect != endpoint.address:
                if not self.replicated:
                    self._lost = f"{endpoint.node_id} at {endpoint.address} is no longer master"
                    return
                known = [e for e in self._endpoints if e.address == redirect]
                self._redirect = known[0] if known else Endpoint("", redirect)
                self._redirect_fresh = True
                return
            if code.name not in INDETERMINATE_AFTER_SEND:
                return  # a definite answer: the endpoint is alive and still master
            if not self.replicated:
                self._lost = (
                    f"lost the master {endpoint.node_id} at {endpoint.address} ({code.name})"
                )
                return
            if self._redirect is not None:
                # The master a slave named failed too: go back to the list, past it.
                positions = [i for i, e in enumerate(self._endpoints) if e == self._redirect]
                self._redirect = None
                if not positions:
                    return  # back to the endpoint the list was on
                self._index = positions[0]
            self._index = (self._index + 1) % len(self._endpoints)

    def can_check_master(self) -> bool:
        """True if this proxy can ask the gateway who the master is."""
        return self._master_of is not None

    def check_master(self, timeout_s: float) -> str:
        """The master's replica address as the gateway knows it ("" if it cannot say)."""
        if self._master_of is None:
            return ""
        try:
            return self._master_of(timeout_s)
        except Exception:
            # Only a hint: a failed check leaves the stream to its own timeout.
            return ""

    def take_redirect(self) -> bool:
        """True once after a slave's redirect named the master the next stream goes to."""
        with self._lock:
            fresh, self._redirect_fresh = self._redirect_fresh, False
        return fresh

    def lost_error(self, error: SquallError) -> SquallError | None:
        """The error the app sees for a batch that failed with `error` once lost, else None."""
        with self._lock:
            if not self._lost:
                return None
            message = self._lost_message()
        return PublisherLost(
            f"{message}: {error.details}", error.code, maybe_stored=error.maybe_stored
        )

    def _lost_message(self) -> str:
        return (
            f"non-replicated publisher lost its binding ({self._lost}); "
            "ask the topic for a new publisher"
        )

    def release(self) -> list[Any]:
        """Marks the proxy closed and hands over the channels it opened, for the caller to
        close (an asyncio channel's close is a coroutine)."""
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        return channels

    def close(self) -> None:
        """Closes the channels this proxy opened."""
        for channel in self.release():
            channel.close()


Binding = GatewayBinding | ProxyBinding
