"""Links between clusters, the parts that need no second cluster: the [[remotes]] entries
of the cluster file and what an app hears when the remote cluster refuses (issue 19
items 2 and 6).

Goal: a remote is configured with a clear error naming the field for each mistake, and a
remote that is unreachable, presents the wrong TLS identity or refuses the token is
reported naming the remote and the cause. A link whose remote refuses a batch for good
stops with the reason and an ERROR line; transient failures are retried (one master over
the in-memory store, the remote an in-process gRPC server on loopback).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.processes import free_port, free_ports
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2, replica_pb2
from squall_server.common.config import ClusterConfig, RemoteConfig, parse_config
from squall_server.common.errors import Code
from squall_server.replica import commands, links
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.remote import remote_error
from squall_server.replica.store import Store
from tests.unit.test_config import VALID, error_of, parse
from tests.unit.test_writer_riders import counted_appends, role_command

REMOTE = '\n[[remotes]]\nname = "site-b"\ngateways = ["10.0.0.5:7100", "10.0.0.6:7100"]\n'


def test_a_remote_is_read_with_paths_against_the_file() -> None:
    config = parse(VALID + REMOTE + 'ca_file = "b-ca.crt"\ntoken_file = "/run/b.token"\n')
    remote = config.remote("site-b")
    assert remote is not None and config.remote("other") is None
    assert remote.gateways == ("10.0.0.5:7100", "10.0.0.6:7100")
    assert remote.ca_file == Path("/etc/squall/b-ca.crt")
    assert remote.token_file == Path("/run/b.token")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (REMOTE.replace('"site-b"', '"test"'), "is this cluster's own name"),
        (REMOTE + REMOTE, "is listed twice"),
        (REMOTE.replace('"10.0.0.5:7100", ', '"10.0.0.5", '), "remotes[0].gateways"),
        (REMOTE.replace('["10.0.0.5:7100", "10.0.0.6:7100"]', "[]"), "non-empty list"),
        ('\n[[remotes]]\nname = "x"\n', "remotes[0].gateways: required key is missing"),
        (REMOTE + 'token = "secret"\n', "unknown key 'token'"),
    ],
)
def test_remote_mistakes_are_named(text: str, words: str) -> None:
    assert words in error_of(VALID + text)


def _remote(**kw: object) -> RemoteConfig:
    args: dict[str, object] = {"name": "site-b", "gateways": ("10.0.0.5:7100",)}
    args.update(kw)
    return RemoteConfig(**args)  # type: ignore[arg-type]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_a_refused_token_names_the_token_file() -> None:
    error = remote_error(
        _remote(token_file=Path("/run/b.token")),
        _rpc_error(grpc.StatusCode.UNAUTHENTICATED, "invalid token"),
        "find topic 'orders'",
    )
    assert error.code == Code.FAILED_PRECONDITION
    assert "remote cluster 'site-b' at 10.0.0.5:7100 refused find topic 'orders'" in error.message
    assert "the token in /run/b.token was refused" in error.message
    missing = remote_error(
        _remote(), _rpc_error(grpc.StatusCode.UNAUTHENTICATED, "no token"), "find topic 'x'"
    )
    assert "no token is configured (remotes.token_file)" in missing.message


def test_a_wrong_tls_identity_names_what_was_expected() -> None:
    error = remote_error(
        _remote(ca_file=Path("/etc/squall/b-ca.crt"), server_name="gw.site-b"),
        _rpc_error(grpc.StatusCode.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED"),
        "find topic 'orders'",
    )
    assert error.code == Code.FAILED_PRECONDITION
    assert "TLS handshake failed" in error.message
    assert "a certificate for gw.site-b from the CA in /etc/squall/b-ca.crt" in error.message


def test_an_unreachable_remote_and_a_missing_topic() -> None:
    down = remote_error(
        _remote(), _rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), "find topic 'o'"
    )
    assert down.code == Code.FAILED_PRECONDITION
    assert "could not find topic 'o' (UNAVAILABLE: connection refused)" in down.message
    missing = remote_error(
        _remote(), _rpc_error(grpc.StatusCode.NOT_FOUND, "topic 'o' does not exist"), "find"
    )
    assert missing.code == Code.NOT_FOUND and "site-b" in missing.message


# --- a remote that refuses a batch for good (issue 19: the link stops, it does not spin)


class _RefusingRemote(broker_pb2_grpc.PublisherServicer):
    """Another cluster's gateway answering each forwarded batch with the next status."""

    def __init__(self, answers: list[grpc.StatusCode]) -> None:
        self.answers = answers
        self.calls = 0

    async def Publish(
        self, request: broker_pb2.PublishRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> broker_pb2.PublishResponse:
        code = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        await context.abort(code, f"answer {self.calls}: event 0 breaks limits.max_event_bytes")
        raise AssertionError("abort returned")


def _one_node_with_remote(tmp_path: Path, remote_address: str) -> ClusterConfig:
    ports = free_ports(3)  # together: ports picked one by one may repeat
    text = (
        '[cluster]\nname = "site-a"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        f'coordinator_address = "127.0.0.1:{ports[0]}"\n'
        f'replica_address = "127.0.0.1:{ports[1]}"\ndata_dir = "n1"\n'
        f'\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:{ports[2]}"\n'
        f'\n[[remotes]]\nname = "site-b"\ngateways = ["{remote_address}"]\n'
    )
    config = parse_config(text, tmp_path / "cluster.toml")
    config.nodes[0].data_dir.mkdir(parents=True, exist_ok=True)
    return config


# Bounds on the waits below (a loaded machine is slow, never wrong).
_WAIT_MAX_S = 20.0
# How long a stopped link is watched for a call it should not make (many rescans).
_STILL_S = 0.5


_ONE_EVENT = broker_pb2.PublishRequest(topic="a", events=[common_pb2.EventData()])


@contextlib.asynccontextmanager
async def _master_linked_to(
    tmp_path: Path, remote_server: broker_pb2_grpc.PublisherServicer
) -> AsyncIterator[tuple[ReplicaNode, replica_pb2.LinkTopicOp]]:
    """A one-node master whose topic `a` links to orders@site-b (served by remote_server
    on loopback), one event published on `a`; yields the node and the link."""
    grpc_server = grpc.aio.server()
    broker_pb2_grpc.add_PublisherServicer_to_server(remote_server, grpc_server)
    address = f"127.0.0.1:{free_port()}"
    grpc_server.add_insecure_port(address)
    await grpc_server.start()
    config = _one_node_with_remote(tmp_path, address)
    node = build_replica_node(config, config.node("n1"), Store.open_memory())
    await node.start()
    try:
        await node.apply_role(role_command(common_pb2.ROLE_MASTER, 1, 1))
        await node.write(commands.CreateTopic("a", common_pb2.TOPIC_KIND_REPLICATED))
        await node.write(
            commands.LinkTopic("a", "orders", 0, "site-b", common_pb2.TOPIC_KIND_REPLICATED)
        )
        await node.write(commands.Publish(_ONE_EVENT))
        (link,) = node.store.list_links("a")
        yield node, link
    finally:
        await node.stop()
        await grpc_server.stop(None)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(int(_WAIT_MAX_S / 0.05)):  # bounded
        if condition():
            return
        await asyncio.sleep(0.05)


def _run_link_against(
    tmp_path: Path, answers: list[grpc.StatusCode], enough: Callable[[int, str], bool]
) -> tuple[_RefusingRemote, str, int]:
    """One master forwarding one event of `a` to orders@site-b; returns the remote, the
    link's stopped reason and its next offset once `enough(calls, reason)` holds (or
    _WAIT_MAX_S passed), and _STILL_S more."""
    remote_server = _RefusingRemote(answers)

    async def scenario() -> tuple[str, int]:
        async with _master_linked_to(tmp_path, remote_server) as (node, link):
            await _until(lambda: enough(remote_server.calls, node.links.stopped_reason(link)))
            await asyncio.sleep(_STILL_S)
            return node.links.stopped_reason(link), node.links.position(link)

    reason, position = asyncio.run(scenario())
    return remote_server, reason, position


@pytest.fixture(autouse=True)
def _rescan_often(monkeypatch: pytest.MonkeyPatch) -> None:
    # The supervisor finds the new link at once, and would restart a stopped one soon.
    monkeypatch.setattr(links, "_RESCAN_S", 0.05)


def test_a_batch_refused_for_good_stops_the_link_with_the_reason_and_an_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="squall.replica.links")
    answers = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT]
    remote_server, reason, position = _run_link_against(tmp_path, answers, lambda _, why: bool(why))
    # Offered again after the transient failure, then never after the refusal.
    assert remote_server.calls == 2
    assert position == 0, "the cursor moved past a batch the remote never took"
    assert reason.startswith("stopped at offset 0 (offsets 0..0 refused for good")
    assert "remote cluster 'site-b'" in reason and "INVALID_ARGUMENT: answer 2" in reason
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "forwarding stopped (epoch=1)" in errors[0].getMessage()
    assert "link 'a' -> 'orders' on cluster 'site-b'" in errors[0].getMessage()


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
    ],
)
def test_transient_refusals_are_retried_and_never_stop_the_link(
    tmp_path: Path, code: grpc.StatusCode
) -> None:
    retried = _run_link_against(tmp_path, [code], lambda calls, _: calls >= 3)
    remote_server, reason, position = retried
    assert remote_server.calls >= 3, "not retried"  # after 0.2 s, 0.4 s, ... of backoff
    assert reason == "" and position == 0


class _FixableRemote(broker_pb2_grpc.PublisherServicer):
    """Another cluster's gateway that refuses every batch for good (its topic is missing)
    until the test fixes it, then takes them."""

    def __init__(self) -> None:
        self.fixed = False
        self.calls = 0
        self.events = 0

    async def Publish(
        self, request: broker_pb2.PublishRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> broker_pb2.PublishResponse:
        self.calls += 1
        if not self.fixed:
            await context.abort(grpc.StatusCode.NOT_FOUND, "topic 'orders' does not exist")
        self.events += len(request.events)
        return broker_pb2.PublishResponse()


def test_a_retried_link_forwards_the_refused_batch_and_a_retry_of_a_running_link_does_nothing(
    tmp_path: Path,
) -> None:
    remote_server = _FixableRemote()

    async def scenario() -> dict[str, Any]:
        async with _master_linked_to(tmp_path, remote_server) as (node, link):
            await _until(lambda: bool(node.links.stopped_reason(link)))
            remote_server.fixed = True
            await asyncio.sleep(_STILL_S)  # many rescans: none restarts a stopped link
            seen: dict[str, Any] = {"calls before the retry": remote_server.calls}
            seen["reason"] = await node.links.retry(link)
            await _until(lambda: node.links.position(link) == 1)
            await _until(lambda: node.store.list_links("a")[0].cursor == 1)
            seen["stopped after"] = node.links.stopped_reason(link)
            seen["second retry"] = await node.links.retry(link)
            await asyncio.sleep(_STILL_S)
            seen["position"] = node.links.position(link)
            return seen

    seen = asyncio.run(scenario())
    assert seen["calls before the retry"] == 1, "a stopped link was offered again unasked"
    assert seen["reason"].startswith("stopped at offset 0 (offsets 0..0 refused for good")
    assert seen["stopped after"] == "" and seen["second retry"] == ""
    assert remote_server.events == 1, "the refused batch not forwarded once after the retry"
    assert seen["position"] == 1


# --- the cursor rides with the next commit batch (issue 16: no commit round of its own)


class _AcceptingRemote(broker_pb2_grpc.PublisherServicer):
    """Another cluster's gateway taking every forwarded batch."""

    def __init__(self) -> None:
        self.events = 0

    async def Publish(
        self, request: broker_pb2.PublishRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> broker_pb2.PublishResponse:
        self.events += len(request.events)
        return broker_pb2.PublishResponse()


def test_a_forwarded_batchs_cursor_shares_the_next_publishs_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Longer than the test runs: the cursor goes only with another write.
    monkeypatch.setattr(links, "_CURSOR_RIDE_S", 600.0)
    remote_server = _AcceptingRemote()

    async def scenario() -> tuple[list[int], int, int]:
        async with _master_linked_to(tmp_path, remote_server) as (node, link):
            await _until(lambda: node.links.position(link) == 1)
            await asyncio.sleep(_STILL_S)
            (waiting,) = node.store.list_links("a")
            appends = counted_appends(node)
            await node.write(commands.Publish(_ONE_EVENT))
            await _until(lambda: node.links.position(link) == 2)  # the next pass forwards it
            (ridden,) = node.store.list_links("a")
            return appends, waiting.cursor, ridden.cursor

    appends, waiting, ridden = asyncio.run(scenario())
    assert remote_server.events == 2
    assert waiting == 0, "the cursor was written alone, with no batch to ride with"
    # The second publish's append carried the first batch's cursor: one fsync, one round.
    assert appends[0] == 2 and ridden >= 1
