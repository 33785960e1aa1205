"""Real Squall servicers in process, on real gRPC servers on loopback, for the fuzz tests.

The services run on an asyncio loop in a background thread, exactly as their processes
build them (``serve()`` of each service's ``__main__``, or the same servicers over a
ServiceServer); the test thread calls them as any client would, with a plain gRPC
channel and the request already serialized, so hostile bytes reach the server as sent.

``outcome`` makes one call and returns how it ended; ``problem`` says what is wrong with
that ending (an unhandled exception in a handler, an INTERNAL status, a status with no
message, a unary call that hung), or None. Handler exceptions that a client never sees
(a streaming handler failing after its last message) are caught from the log:
``ServicerErrors`` collects what gRPC logs as "Unexpected error" / "raised by servicer".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor as d
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.processes import free_ports
from squall.v1 import broker_pb2
from squall.wire.long_poll import PULL_METHOD
from squall_server.common.config import ClusterConfig, parse_config

T = TypeVar("T")

UNARY_TIMEOUT_S = 10.0
# A server stream is read for at most this long, then cancelled: follow-mode subscribes
# and group-view watches never end on their own.
STREAM_TIMEOUT_S = 0.2
STREAM_MESSAGES_MAX = 3
START_TIMEOUT_S = 30.0


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = START_TIMEOUT_S) -> T:
        """Runs coroutine on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        """Stops the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


def config_text(data_root: Path, node_count: int, *, gateway: bool = True) -> str:
    """A cluster of node_count nodes on free loopback ports, with small limits and timeouts
    so that a hostile request meets a limit quickly and nothing waits long."""
    ports = iter(free_ports(2 * node_count + 1))  # together: one by one may repeat
    nodes = "".join(
        f"""
[[nodes]]
id = "n{i}"
priority = {node_count + 1 - i}
coordinator_address = "127.0.0.1:{next(ports)}"
replica_address = "127.0.0.1:{next(ports)}"
data_dir = "{data_root / f"n{i}"}"
"""
        for i in range(1, node_count + 1)
    )
    gateways = f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{next(ports)}"\n'
    return f"""
[cluster]
name = "fuzz"
{nodes}{gateways if gateway else ""}
[timeouts]
heartbeat_interval_ms = 100
member_timeout_ms = 1500
# As long as a member's: the services share one event loop here, beside the test's
# client threads, and a loaded CI machine held the replica's answers past the 300 ms
# default, which deposed the one node's master mid-test.
replica_timeout_ms = 1500
probe_interval_ms = 100
merge_delay_ms_per_priority = 10
rpc_timeout_ms = 500
publish_timeout_ms = 2000
push_deliver_timeout_ms = 300
push_retry_backoff_initial_ms = 50
push_retry_backoff_max_ms = 200

[retry]
retry_attempts_max = 2
retry_backoff_initial_ms = 10
retry_backoff_max_ms = 20
retry_total_ms_max = 1000

[limits]
max_event_bytes = 65536
max_batch_events = 1000
push_batch_max_events = 100
push_batch_max_bytes = 1048576
max_batch_bytes = 1048576
max_message_bytes = 8388608
map_size_bytes = 268435456
max_topics = 64
push_subscribers_max = 16
subscribe_batch_max_events = 50

[durability]
master_sync = "WRITE_NO_SYNC"
"""


def make_config(data_root: Path, node_count: int) -> ClusterConfig:
    """config_text parsed (the data root must exist)."""
    data_root.mkdir(parents=True, exist_ok=True)
    path = data_root / "cluster.toml"
    text = config_text(data_root, node_count)
    path.write_text(text)
    return parse_config(text, path)


@dataclass(frozen=True)
class Method:
    """One RPC: its path, request type and streaming shape."""

    service: str
    name: str
    path: str
    request: d.Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def id(self) -> str:
        return f"{self.service}.{self.name}"


def methods(file_descriptor: d.FileDescriptor, service: str) -> list[Method]:
    """Every method of a service, as Method records."""
    svc = file_descriptor.services_by_name[service]
    return [
        Method(
            service,
            m.name,
            f"/{svc.full_name}/{m.name}",
            m.input_type,
            m.client_streaming,
            m.server_streaming,
        )
        for m in svc.methods
    ]


@dataclass(frozen=True)
class Raw:
    """Bytes sent as a request as they are, whether or not they parse as its type."""

    data: bytes

    def SerializeToString(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return f"raw {self.data!r}"


@dataclass(frozen=True)
class Outcome:
    """How one call ended."""

    code: grpc.StatusCode
    details: str
    responses: int


# A Pull's wait_ms is the one field whose value only makes a call longer: the master waits
# that long (at most PULL_WAIT_MAX_MS) for an event when none is ready. Examples that ask
# for more wait this long, so that a deep run's many examples stay within the test's
# timeout; the wait itself is tested in tests/integration/test_shared_subscription.py.
PULL_WAIT_FUZZ_MAX_MS = 1_000


def _short_wait(method: Method, raw: bytes) -> bytes:
    """raw, with a Pull's wait cut to PULL_WAIT_FUZZ_MAX_MS (raw bytes that do not parse
    are sent as they are: the master refuses them at once)."""
    if method.path != PULL_METHOD:
        return raw
    try:
        request = broker_pb2.PullRequest.FromString(raw)
    except DecodeError:
        return raw
    if request.wait_ms <= PULL_WAIT_FUZZ_MAX_MS:
        return raw
    request.wait_ms = PULL_WAIT_FUZZ_MAX_MS
    return request.SerializeToString()


def outcome(
    channel: grpc.Channel,
    method: Method,
    requests: list[Message | Raw],
    metadata: tuple[tuple[str, str], ...] = (),
) -> Outcome:
    """Makes one call with requests (one, or a stream of them) and says how it ended."""
    raw = [_short_wait(method, r.SerializeToString()) for r in requests]
    ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    count = 0
    try:
        if method.client_streaming and method.server_streaming:
            stream = channel.stream_stream(method.path, ident, ident)
            call = stream(iter(raw), timeout=STREAM_TIMEOUT_S * 3, metadata=metadata)
            count = _drain(call)
        elif method.server_streaming:
            call = channel.unary_stream(method.path, ident, ident)(
                raw[0], timeout=STREAM_TIMEOUT_S, metadata=metadata
            )
            count = _drain(call)
        elif method.client_streaming:
            channel.stream_unary(method.path, ident, ident)(
                iter(raw), timeout=UNARY_TIMEOUT_S, metadata=metadata
            )
            count = 1
        else:
            channel.unary_unary(method.path, ident, ident)(
                raw[0], timeout=UNARY_TIMEOUT_S, metadata=metadata
            )
            count = 1
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", count)
    return Outcome(grpc.StatusCode.OK, "", count)


def _drain(call: Any) -> int:
    """Reads up to STREAM_MESSAGES_MAX responses, then cancels the call."""
    count = 0
    for _ in call:
        count += 1
        if count >= STREAM_MESSAGES_MAX:
            call.cancel()
            break
    return count


def problem(method: Method, result: Outcome) -> str | None:
    """What is wrong with how a call ended (None: a clear answer)."""
    code, details = result.code, result.details
    if code == grpc.StatusCode.OK:
        return None
    if code == grpc.StatusCode.CANCELLED and result.responses >= STREAM_MESSAGES_MAX:
        return None  # we cancelled it
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if method.server_streaming:
            return None  # a stream still open when we stopped reading
        return f"{method.id} hung: no answer within {UNARY_TIMEOUT_S}s"
    if code == grpc.StatusCode.INTERNAL:
        return f"{method.id} answered INTERNAL: {details!r}"
    if code == grpc.StatusCode.UNKNOWN and (
        details.startswith("Unexpected") or "Exception calling application" in details
    ):
        return f"{method.id} raised an unhandled exception: {details!r}"
    if not details.strip():
        return f"{method.id} answered {code.name} with no message"
    return None


class ServicerErrors(logging.Handler):
    """Collects the exceptions gRPC logs from servicer methods (unhandled in a handler)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info or "raised by servicer" in message or "Unexpected" in message:
            self.errors.append(f"{record.name}: {message}")

    def take(self) -> list[str]:
        """The errors collected since the last take."""
        errors, self.errors = self.errors, []
        return errors


def healthy(address: str) -> bool:
    """The server at address answers its health check with SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def wait_until(
    condition: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Polls condition until it holds; raises AssertionError naming what after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)
