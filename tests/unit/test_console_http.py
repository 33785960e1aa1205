"""The console's HTTP handlers without a browser: a real ConsoleServer on a free loopback
port, its backend talking to an in-memory stand-in for the client library (the cluster's
answers as the library returns them), asked with urllib as a page or a script would.

Covers the JSON API (snapshot, event stream, topic view, publish, actions), bad input
(issue 21 item 5: a 4xx JSON answer naming the problem, nothing changed), and the token.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

import squall
from squall._types import SlaveProgress  # not exported: only status builds it
from squall_server.cli import admin as cli_admin
from squall_server.cli import main
from squall_server.common.clock import ManualClock
from squall_server.common.config import ClusterConfig, ConfigError, parse_config
from squall_server.console.backend import ConsoleBackend
from squall_server.console.history import RATE_WINDOW_MS, TIMELINE_WINDOW_MS, RateMeter, Timeline
from squall_server.console.hosted import serves_console
from squall_server.console.server import ConsoleServer

MAX_EVENT_BYTES = 64


def _node(node_id: str, role: str, master: str = "n1", **extra: Any) -> squall.NodeStatus:
    fields: dict[str, Any] = {
        "node_id": node_id,
        "coordinator_id": master,
        "group_name": f"{master}:1",
        "state": "normal",
        "group": ("n1", "n2", "n3"),
        "max_seen": 1,
        "epoch": 4,
        "role": role,
        "last_change_reason": "elected",
        "last_lsn": 10,
        "commit_lsn": 10,
        "store_state": "open",
        "reachable": True,
        "error": "",
        "replica_address": "127.0.0.1:1",
        "priority": {"n1": 3, "n2": 2, "n3": 1}[node_id],
        "last_epoch": 4,
    }
    fields.update(extra)
    return squall.NodeStatus(**fields)


def _status(master: str = "n1", epoch: int = 4) -> squall.ClusterStatus:
    slave = SlaveProgress(
        "n3", "streaming", 8, 8, 8, 2, 10.0, 0.2, 0, silent_ms=3200, catching_up=True
    )
    nodes = tuple(
        _node(
            n,
            "master" if n == master else "slave",
            master,
            epoch=epoch,
            slaves=(slave,) if n == master else (),
        )
        for n in ("n1", "n2", "n3")
    )
    return squall.ClusterStatus(nodes, master, epoch)


class FakePublisher:
    def __init__(self, topic: FakeTopic) -> None:
        self._topic = topic

    def __enter__(self) -> FakePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def publish(
        self, payload: bytes, key: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> squall.Receipt:
        # The replica's rule, as the gateway answers it: the event's bytes over the limit.
        size = len(payload) + len(key or b"")
        if size > MAX_EVENT_BYTES:
            raise squall.InvalidArgument(
                f"event of {size} bytes is over limits.max_event_bytes {MAX_EVENT_BYTES}"
            )
        offset = self._topic.info.next_offset
        self._topic.events.append(
            squall.Message(offset, key or b"", payload, 1_767_225_600_000, "console-x", 1,
                           dict(headers or {}), "", 11 + offset, 4)
        )  # fmt: skip
        # The replica counts the stored record; the fake counts the payload and key.
        size = self._topic.info.size_bytes
        self._topic.info = dataclasses.replace(
            self._topic.info,
            next_offset=offset + 1,
            size_bytes=None if size is None else size + len(payload) + len(key or b""),
        )
        return squall.Receipt(offset, 11 + offset, 4, False, (), "n1")


class FakeSubscription:
    def __init__(self, messages: list[squall.Message]) -> None:
        self._messages = messages

    def __enter__(self) -> FakeSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __iter__(self) -> Iterator[squall.Message]:
        return iter(self._messages)


class FakeTopic:
    def __init__(self, name: str, kind: str = "replicated") -> None:
        # A transient topic's size is not counted (None), a replicated one's starts at 0.
        size = None if kind == "transient" else 0
        self.info = squall.TopicInfo(name, kind, 0, 0, 0, size)  # type: ignore[arg-type]
        self.events: list[squall.Message] = []

    def subscription_infos(self) -> list[squall.SubscriptionInfo]:
        return [squall.SubscriptionInfo(self.info.name, "audit", 1, self.info.next_offset - 1, 0)]

    def push_subscribers(self) -> list[squall.PushSubscriberInfo]:
        return [
            squall.PushSubscriberInfo(
                self.info.name, "hook", "http://127.0.0.1:9/", {"reliability": "ordered"},
                0, 0, 3, "UNAVAILABLE: connection refused",
            )
        ]  # fmt: skip

    def subscribe(
        self, subscription: None, start: int, follow: bool, end_offset: int
    ) -> FakeSubscription:
        return FakeSubscription([m for m in self.events if start <= m.offset < end_offset])

    def publisher(self) -> FakePublisher:
        return FakePublisher(self)


class FakeClient:
    """The library calls the console makes, answered from memory."""

    address = "127.0.0.1:7100"

    def __init__(self) -> None:
        self.current = _status()
        self.down = False
        self.by_name = {"orders": FakeTopic("orders"), "ticks": FakeTopic("ticks", "transient")}

    def status(self) -> squall.ClusterStatus:
        if self.down:
            raise squall.Unavailable("connection refused")
        return self.current

    def topics(self) -> list[squall.TopicInfo]:
        return [t.info for t in self.by_name.values()]

    def topic(self, name: str) -> FakeTopic:
        if name not in self.by_name:
            raise squall.NotFound(f"topic '{name}' does not exist")
        return self.by_name[name]


@dataclasses.dataclass
class Console:
    base: str
    client: FakeClient
    backend: ConsoleBackend
    clock: ManualClock
    admin_calls: list[argparse.Namespace]

    def request(
        self,
        path: str,
        body: object = None,
        token: str | None = None,
        content_type: str = "application/json",
        cookie: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data)
        if data is not None:
            request.add_header("Content-Type", content_type)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        if cookie is not None:
            request.add_header("Cookie", cookie)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")


def _start(token: str | None, config_path: str | None = "cluster.toml") -> Iterator[Console]:
    client = FakeClient()
    clock = ManualClock()
    calls: list[argparse.Namespace] = []

    def run_admin(args: argparse.Namespace, out: io.StringIO) -> int:
        calls.append(args)
        if args.node == "n3" and args.cluster_command == "transfer":
            raise cli_admin.AdminError("node n1: UNAVAILABLE: connection refused")
        print(f"{args.node}: QUARANTINED ({args.reason})", file=out)
        return 0

    backend = ConsoleBackend(
        client,  # type: ignore[arg-type]
        config_path=config_path,
        clock=clock,
        run_admin=run_admin,
        topic_handle=lambda info: client.by_name[info.name],  # type: ignore[arg-type,return-value]
    )
    backend.poll()
    server = ConsoleServer(("127.0.0.1", 0), backend, token)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield Console(server.url.rstrip("/"), client, backend, clock, calls)
    finally:
        server.stop()
        thread.join(10)


@pytest.fixture
def console() -> Iterator[Console]:
    yield from _start(token=None)


@pytest.fixture
def guarded() -> Iterator[Console]:
    yield from _start(token="s3cret-token")


def test_snapshot_has_the_replica_table_and_the_explanation(console: Console) -> None:
    status, snap = console.request("/api/snapshot")
    assert status == 200
    assert snap["master_id"] == "n1" and snap["epoch"] == 4
    rows = {row["node"]: row for row in snap["replicas"]}
    assert rows["n1"]["master"] and rows["n1"]["role"] == "master" and rows["n1"]["lag"] == 0
    assert rows["n3"]["lag"] == 2  # the master's view of its slave
    assert rows["n2"]["lag"] is None  # the master reported no progress for it
    assert rows["n3"]["heard_ms"] == 3200  # its replica silent: links cut, say
    assert rows["n1"]["heard_ms"] is None and rows["n2"]["heard_ms"] is None
    assert rows["n3"]["catching_up"] is True and rows["n1"]["catching_up"] is None
    assert snap["explain"]["master"] and len(snap["explain"]["if_failed"]) == 3
    assert snap["actions_enabled"] is True
    topics = {t["name"]: t for t in snap["topics"]}
    assert topics["orders"]["kind"] == "replicated" and topics["ticks"]["kind"] == "transient"
    assert snap["push"][0]["failures"] == 3
    assert "connection refused" in snap["push"][0]["last_error"]


def test_rates_and_backlog_follow_the_polls(console: Console) -> None:
    publisher = console.client.by_name["orders"].publisher()
    for _ in range(5):
        publisher.publish(b"x")
    console.clock.advance(1000)
    snap = console.backend.poll()
    orders = next(t for t in snap["topics"] if t["name"] == "orders")
    assert orders["events"] == 5
    assert orders["size_bytes"] == 5  # what the topic info reports, no longer n/a
    ticks = next(t for t in snap["topics"] if t["name"] == "ticks")
    assert ticks["size_bytes"] is None  # not counted: the page shows n/a
    assert orders["publish_rate"] == pytest.approx(5.0)
    subscription = next(s for s in snap["subscriptions"] if s["topic"] == "orders")
    assert subscription["backlog"] == 4


def test_event_stream_sends_each_new_snapshot(console: Console) -> None:
    with urllib.request.urlopen(console.base + "/api/stream", timeout=10) as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"

        def next_event() -> dict[str, Any]:
            lines = []
            while (line := stream.readline().decode()) != "\n":
                lines.append(line)
            assert lines[0] == "event: snapshot\n"
            document: dict[str, Any] = json.loads(lines[1].removeprefix("data: "))
            return document

        assert next_event()["master_id"] == "n1"
        console.client.current = _status(master="n2", epoch=5)
        console.clock.advance(1000)
        console.backend.poll()
        moved = next_event()
        assert moved["master_id"] == "n2"
        assert "n2 is master in epoch 5 (was n1 in epoch 4)" in moved["timeline"][0]["text"]


def test_a_gateway_that_stops_answering_marks_the_page_stale(console: Console) -> None:
    console.client.down = True
    snap = console.backend.poll()
    assert snap["stale"] is True
    assert "did not answer" in snap["error"] and "connection refused" in snap["error"]
    assert snap["master_id"] == "n1"  # the last data stays, marked stale


def test_publish_then_read_back_as_text_and_hex(console: Console) -> None:
    status, receipt = console.request(
        "/api/topics/orders/publish",
        {"payload": "hello", "key": "k1", "headers": {"origin": "page"}},
    )
    assert status == 200 and receipt["offset"] == 0
    status, receipt = console.request(
        "/api/topics/orders/publish", {"payload": "00ff 10", "encoding": "hex"}
    )
    assert status == 200 and receipt["offset"] == 1
    status, view = console.request("/api/topics/orders/events")
    assert status == 200
    first, second = view["events"]
    assert first["payload_text"] == "hello" and first["headers"] == {"origin": "page"}
    assert first["key_text"] == "k1" and first["publisher_id"] == "console-x"
    assert second["payload_text"] is None and second["payload_hex"] == "00ff10"
    status, view = console.request("/api/topics/orders/events?from=1&count=5")
    assert [e["offset"] for e in view["events"]] == [1]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/api/topics/a%20b/events", None, 400, "invalid topic name 'a b'"),
        ("/api/topics/.hidden/events", None, 400, "invalid topic name '.hidden'"),
        ("/api/topics/nope/events", None, 404, "topic 'nope' does not exist"),
        ("/api/topics/orders/events?from=abc", None, 400, "offset must be a whole number"),
        ("/api/topics/orders/events?from=-1", None, 400, "offset must be >= 0"),
        ("/api/topics/orders/events?count=100000", None, 400, "count must be from 1 to 200"),
        ("/api/topics/a%20b/publish", {"payload": "x"}, 400, "invalid topic name"),
        ("/api/topics/nope/publish", {"payload": "x"}, 404, "does not exist"),
        ("/api/topics/orders/publish", {"payload": "x" * 65}, 400, "limits.max_event_bytes"),
        ("/api/topics/orders/publish", {"payload": "zz", "encoding": "hex"}, 400, "not hex"),
        ("/api/topics/orders/publish", {"payload": "x", "encoding": "b64"}, 400, "encoding"),
        ("/api/topics/orders/publish", {"payload": "x", "headers": {"a": 1}}, 400, "headers"),
        ("/api/topics/orders/publish", ["x"], 400, "must be a JSON object"),
        ("/api/nothing", None, 404, "no page"),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_changes_nothing(
    console: Console, path: str, body: object, status: int, words: str
) -> None:
    got, answer = console.request(path, body)
    assert got == status
    assert words in answer["error"]
    assert console.client.by_name["orders"].events == []


def test_a_post_that_is_not_json_is_refused(console: Console) -> None:
    got, answer = console.request(
        "/api/topics/orders/publish", {"payload": "x"}, content_type="text/plain"
    )
    assert got == 415 and "application/json" in answer["error"]
    assert console.client.by_name["orders"].events == []


def test_a_transient_topic_has_nothing_to_read_back(console: Console) -> None:
    status, view = console.request("/api/topics/ticks/events")
    assert status == 200 and view["events"] == [] and "transient" in view["note"]


def test_actions_need_confirmation_and_go_through_the_cli(console: Console) -> None:
    got, answer = console.request("/api/actions", {"action": "quarantine", "node": "n3"})
    assert got == 400 and "not confirmed" in answer["error"]
    got, answer = console.request(
        "/api/actions", {"action": "reboot", "node": "n3", "confirm": "n3"}
    )
    assert got == 400 and "action must be one of" in answer["error"]
    got, answer = console.request(
        "/api/actions", {"action": "quarantine", "node": "n9", "confirm": "n9"}
    )
    assert got == 404 and "no node 'n9'" in answer["error"]
    assert console.admin_calls == []
    got, answer = console.request(
        "/api/actions",
        {"action": "quarantine", "node": "n3", "confirm": "n3", "reason": "disk errors"},
    )
    assert got == 200 and "QUARANTINED" in answer["result"]
    (call,) = console.admin_calls
    assert call.cluster_command == "quarantine" and call.config == "cluster.toml"
    assert call.reason == "console: disk errors"  # the audit trail says where it came from
    got, answer = console.request(
        "/api/actions", {"action": "transfer", "node": "n3", "confirm": "n3"}
    )
    assert got == 502 and "UNAVAILABLE" in answer["error"]


def test_actions_without_the_cluster_file_are_refused() -> None:
    with contextlib.closing(_start(token=None, config_path=None)) as started:
        console = next(started)
        got, answer = console.request(
            "/api/actions", {"action": "quarantine", "node": "n3", "confirm": "n3"}
        )
        assert got == 409 and "--config" in answer["error"]
        assert console.request("/api/snapshot")[1]["actions_enabled"] is False


def test_a_token_protected_console_refuses_requests_without_it(guarded: Console) -> None:
    got, answer = guarded.request("/api/snapshot")
    assert got == 401 and "token" in answer["error"]
    assert guarded.request("/api/snapshot", token="wrong")[0] == 401
    got, _ = guarded.request(
        "/api/topics/orders/publish", {"payload": "x"}, cookie="squall_console=wrong"
    )
    assert got == 401 and guarded.client.by_name["orders"].events == []
    assert guarded.request("/api/snapshot", token="s3cret-token")[0] == 200
    assert guarded.request("/api/snapshot", cookie="squall_console=s3cret-token")[0] == 200


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_the_login_form_sets_the_cookie(guarded: Console) -> None:
    opener = urllib.request.build_opener(_NoRedirect)
    with pytest.raises(urllib.error.HTTPError) as page:
        opener.open(guarded.base + "/", timeout=10)
    assert page.value.code == 303 and page.value.headers["Location"] == "/login"
    with opener.open(guarded.base + "/login", timeout=10) as login:
        assert b"token" in login.read()
    with pytest.raises(urllib.error.HTTPError) as wrong:
        opener.open(guarded.base + "/login", data=b"token=nope", timeout=10)
    assert wrong.value.headers["Location"] == "/login?failed=1"
    assert "Set-Cookie" not in wrong.value.headers
    with pytest.raises(urllib.error.HTTPError) as right:
        opener.open(guarded.base + "/login", data=b"token=s3cret-token", timeout=10)
    assert right.value.headers["Location"] == "/"
    cookie = right.value.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert guarded.request("/api/snapshot", cookie=cookie.split(";")[0])[0] == 200


def test_the_page_and_its_files_are_served(console: Console) -> None:
    with urllib.request.urlopen(console.base + "/", timeout=10) as page:
        html = page.read().decode()
    assert 'id="replicas"' in html and "/static/console.js" in html
    with urllib.request.urlopen(console.base + "/static/console.js", timeout=10) as script:
        assert script.headers["Content-Type"].startswith("text/javascript")
        assert b"EventSource" in script.read()
    got, _ = console.request("/static/../backend.py")
    assert got == 404


def test_timeline_keeps_an_hour_of_master_changes_and_operator_records() -> None:
    timeline = Timeline()
    timeline.observe(1_000, _status("n1", 4))
    quarantined = _status("n2", 5)
    record = squall.OperatorRecord(2_500, "alice", "quarantine", "disk")
    nodes = tuple(
        dataclasses.replace(n, audit=(record,)) if n.node_id == "n1" else n
        for n in quarantined.nodes
    )
    timeline.observe(3_000, squall.ClusterStatus(nodes, "n2", 5))
    timeline.observe(4_000, squall.ClusterStatus(nodes, "n2", 5))  # nothing new
    texts = [e.text for e in timeline.entries(4_000)]
    assert texts == [
        "console started: master n1 in epoch 4",
        "n1: alice: quarantine: disk",
        "n2 is master in epoch 5 (was n1 in epoch 4)",
    ]
    assert [e.text for e in timeline.entries(3_000 + TIMELINE_WINDOW_MS)] == [texts[2]]


def test_rate_meter_measures_over_its_window_and_restarts_on_a_reset() -> None:
    meter = RateMeter()
    assert meter.sample("t", 0, 0) == 0.0
    assert meter.sample("t", 1000, 10) == pytest.approx(10.0)
    assert meter.sample("t", RATE_WINDOW_MS + 2000, 10) == pytest.approx(0.0)
    assert meter.sample("t", RATE_WINDOW_MS + 3000, 0) == 0.0  # a recreated topic


_CLUSTER_FILE = """
[cluster]
name = "c"
[[nodes]]
id = "n1"
priority = 1
coordinator_address = "127.0.0.1:7101"
replica_address = "127.0.0.1:7201"
data_dir = "d1"
[[gateways]]
id = "g1"
address = "127.0.0.1:7100"
[[gateways]]
id = "g2"
address = "127.0.0.1:7110"
"""


def _console_config(section: str) -> ClusterConfig:
    return parse_config(_CLUSTER_FILE + "[console]\n" + section, "/etc/squall/c.toml")


def test_console_section_defaults_and_which_gateway_serves_it() -> None:
    config = parse_config(_CLUSTER_FILE, "/etc/squall/c.toml")
    assert config.console.enabled is False
    assert not serves_console(config, config.gateways[0])
    config = _console_config('enabled = true\ntoken_file = "console.token"\ngateway = "g2"')
    assert config.console.address == "127.0.0.1:7180"
    assert str(config.console.token_file) == "/etc/squall/console.token"
    assert not serves_console(config, config.gateways[0])
    assert serves_console(config, config.gateways[1])


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ('enabled = true\ngateway = "g9"', "console.gateway: no gateway 'g9'; configured: g1, g2"),
        ('enabled = true\naddress = "localhost"', "console.address: 'localhost': must be"),
        ('enabled = true\naddress = "10.1.2.3:7180"', "is not a loopback address"),
        ("enabled = true\npoll_interval_ms = 50", "console.poll_interval_ms: must be an integer"),
        ('enabled = "yes"', "console.enabled: must be true or false"),
        ("enable = true", "unknown key 'enable' in [console]"),
    ],
)
def test_console_section_errors_name_the_key(section: str, words: str) -> None:
    with pytest.raises(ConfigError) as error:
        _console_config(section)
    assert words in error.value.message


def test_console_section_needs_a_token_when_auth_is_on() -> None:
    auth = (
        '[auth]\nenabled = true\n[[auth.principals]]\nname = "ops"\n'
        f'token_sha256 = "{"a" * 64}"\nadmin = true\n'
    )
    with pytest.raises(ConfigError) as error:
        parse_config(_CLUSTER_FILE + auth + "[console]\nenabled = true\n", "/c.toml")
    assert "console.token_file: required when [auth] is on" in error.value.message


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--listen", "7180"], "--listen must be HOST:PORT, not '7180'"),
        (["--listen", "127.0.0.1:http"], "--listen port must be a number"),
        (["--listen", "0.0.0.0:7180"], "is not a loopback address: give the console a token"),
        (["--poll-ms", "5"], "--poll-ms must be 200-10000, not 5"),
        (["--https-cert", "c.pem"], "--https-cert and --https-key go together"),
    ],
)
def test_squall_console_refuses_a_bad_command_line(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SQUALL_TOKEN", raising=False)
    monkeypatch.delenv("SQUALL_TOKEN_FILE", raising=False)
    assert main(["console", "--gateway", "127.0.0.1:1", *args]) == 2
    assert words in capsys.readouterr().err
