"""The console's view of the cluster: it polls the gateway's public API through the client
library (as `squall status --explain`, `topic list`, `topic subscribers` and `subscription
info` do), reads and publishes events as `squall subscribe` and `squall publish` do, and
runs operator actions through the CLI's own `squall cluster` code, so they land in the
same audit trail. Every answer is a JSON-ready dict; every refusal a ConsoleError with
the HTTP status and a message that names the problem.
"""

from __future__ import annotations

import argparse
import io
import threading
from collections.abc import Callable
from typing import Any

import squall
from squall_server.cli import admin as cli_admin
from squall_server.cli import explain as cli_explain
from squall_server.common.clock import Clock, SystemClock
from squall_server.common.names import validate_node_id, validate_topic_name
from squall_server.console.history import REASON_CHARS_MAX, RateMeter, Timeline

# How often the console asks the gateway for the status (the page updates as often).
DEFAULT_POLL_INTERVAL_MS = 1_000
# Topics whose subscriptions and push subscribers are polled each round; past it the topic
# table still lists every topic (a cluster with thousands is summarized, not walked).
TOPICS_DETAIL_MAX = 100
# Recent events one topic view shows by default, and at most.
RECENT_EVENTS_DEFAULT = 20
RECENT_EVENTS_MAX = 200
# Seconds the CLI gives an operator call and a transfer's catch-up (as `squall cluster`).
ACTION_TIMEOUT_S = 5.0
TRANSFER_WAIT_MS = 5_000
ACTIONS = ("transfer", "quarantine", "unquarantine")

_HTTP_STATUS: dict[type[squall.SquallError], int] = {
    squall.NotFound: 404,
    squall.InvalidArgument: 400,
    squall.AlreadyExists: 409,
    squall.FailedPrecondition: 409,
    squall.PermissionDenied: 403,
    squall.Unauthenticated: 403,
    squall.ResourceExhausted: 429,
    squall.Unavailable: 503,
    squall.DeadlineExceeded: 504,
}


class ConsoleError(Exception):
    """A request the console refuses or could not carry out (HTTP status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def from_squall(err: squall.SquallError, doing: str) -> ConsoleError:
    """The gateway's answer as an HTTP status and a message saying what was being done."""
    status = next((code for kind, code in _HTTP_STATUS.items() if isinstance(err, kind)), 502)
    return ConsoleError(status, f"{doing}: {err}")


def _text_or_none(data: bytes) -> str | None:
    """UTF-8 text without control characters (tabs and newlines allowed), else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any((ord(c) < 0x20 and c not in "\t\n\r") or ord(c) == 0x7F for c in text):
        return None
    return text


def message_document(message: squall.Message) -> dict[str, Any]:
    """One event for the topic view: payload as text when it is text, always as hex."""
    return {
        "offset": message.offset,
        "timestamp_ms": message.timestamp_ms,
        "publisher_id": message.publisher_id,
        "sequence": message.sequence,
        "key_text": _text_or_none(message.key),
        "key_hex": message.key.hex(),
        "payload_text": _text_or_none(message.payload),
        "payload_hex": message.payload.hex(),
        "payload_bytes": len(message.payload),
        "headers": dict(message.headers),
        "lsn": message.lsn,
        "epoch": message.epoch,
    }


def _parse_int(value: str, what: str, lowest: int, highest: int | None = None) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ConsoleError(400, f"{what} must be a whole number, not {value!r}") from None
    if number < lowest or (highest is not None and number > highest):
        bound = f"from {lowest} to {highest}" if highest is not None else f">= {lowest}"
        raise ConsoleError(400, f"{what} must be {bound}, not {number}")
    return number


def check_topic_name(name: str) -> None:
    """ConsoleError 400 naming the rule unless the topic name parses."""
    try:
        validate_topic_name(name)
    except ValueError as err:
        raise ConsoleError(400, str(err)) from None


def decode_payload(body: dict[str, Any]) -> tuple[bytes, bytes | None, dict[str, str]]:
    """The publish form's payload (text or hex), key and headers, or ConsoleError 400."""
    payload = body.get("payload", "")
    encoding = body.get("encoding", "text")
    if not isinstance(payload, str):
        raise ConsoleError(400, "payload must be a string")
    if encoding == "text":
        data = payload.encode("utf-8")
    elif encoding == "hex":
        try:
            data = bytes.fromhex(payload)
        except ValueError:
            raise ConsoleError(
                400, "payload is not hex: give pairs of 0-9 a-f digits (spaces allowed)"
            ) from None
    else:
        raise ConsoleError(400, f"encoding must be 'text' or 'hex', not {encoding!r}")
    key = body.get("key") or None
    if key is not None and not isinstance(key, str):
        raise ConsoleError(400, "key must be a string")
    headers = body.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ConsoleError(400, "headers must be an object of string names to string values")
    return data, key.encode("utf-8") if key is not None else None, headers


def _overrides(node: squall.NodeStatus) -> list[str]:
    found = []
    if node.quorum_override:
        found.append(f"quorum override {node.quorum_override}")
    if node.designated_primary:
        found.append("designated primary")
    if node.transfer_target:
        found.append(f"handing over to {node.transfer_target}")
    return found


def replica_rows(status: squall.ClusterStatus) -> list[dict[str, Any]]:
    """The replica table: one row per configured node, with the master's view of its lag
    and of how long ago it last heard from its replica."""
    slaves = {
        slave.node_id: slave
        for node in status.nodes
        if node.reachable and node.node_id == status.master_id
        for slave in node.slaves
    }
    rows = []
    for node in status.nodes:
        answered = node.reachable or bool(node.coordinator_id)
        slave = slaves.get(node.node_id)  # None for the master, and for one not reported
        rows.append(
            {
                "node": node.node_id,
                "coordinator": node.coordinator_id or "-",
                "group_name": node.group_name or "-",
                "group": list(node.group),
                "role": node.role if node.reachable else "-",
                "state": cli_explain.state_of(node) if answered else "unreachable",
                "epoch": node.epoch,
                "lsn": node.last_lsn,
                "commit_lsn": node.commit_lsn,
                "lag": 0
                if node.node_id == status.master_id
                else (slave.lag_entries if slave is not None else None),
                "heard_ms": slave.silent_ms if slave is not None else None,
                "catching_up": slave.catching_up if slave is not None else None,
                "max": node.max_seen,
                "priority": node.priority,
                "quarantine": (
                    {
                        "operator": node.quarantine.operator,
                        "at": cli_explain.when(node.quarantine.at_ms),
                        "reason": node.quarantine.reason,
                    }
                    if node.quarantine is not None
                    else None
                ),
                "overrides": _overrides(node),
                "reason": cli_explain.reason_of(node) if answered else node.error or "-",
                "master": node.node_id == status.master_id,
            }
        )
    return rows


class ConsoleBackend:
    """Polls the gateway, keeps the last snapshot, answers the page's requests."""

    def __init__(
        self,
        client: squall.Client,
        *,
        config_path: str | None = None,
        clock: Clock | None = None,
        poll_interval_ms: int = DEFAULT_POLL_INTERVAL_MS,
        run_admin: Callable[[argparse.Namespace, io.StringIO], int] = cli_admin.run,
        topic_handle: Callable[[squall.TopicInfo], squall.Topic] | None = None,
    ) -> None:
        self._client = client
        self._config_path = config_path
        self._clock = clock or SystemClock()
        self.poll_interval_ms = poll_interval_ms
        self._run_admin = run_admin
        # A listed topic's handle without another RetrieveTopic call (tests swap it).
        self._topic_handle = topic_handle or (lambda info: squall.Topic(client, info))
        self._timeline = Timeline()
        self._rates = RateMeter()
        self._changed = threading.Condition()
        self._version = 0
        self._snapshot: dict[str, Any] = {"at_ms": 0, "error": "not polled yet"}
        self._last_status: squall.ClusterStatus | None = None

    @property
    def gateway(self) -> str:
        """The gateway's address."""
        return self._client.address

    # -- the live snapshot --------------------------------------------------------------

    def poll(self) -> dict[str, Any]:
        """One round: status, explanation, topics and their consumers; publishes the result
        to every waiting event stream. A failed round keeps the last data, marked stale."""
        now_ms = self._clock.wall_ms()
        snapshot: dict[str, Any] = {"at_ms": now_ms, "gateway": self._client.address}
        snapshot["actions_enabled"] = self._config_path is not None
        try:
            status = self._client.status()
        except squall.SquallError as err:
            message = f"the gateway at {self._client.address} did not answer: {err}"
            if self._snapshot.get("error") != message:
                self._timeline.note(now_ms, "console", message[:REASON_CHARS_MAX])
            snapshot.update(self._snapshot_data_only())
            snapshot["error"] = message
            snapshot["stale"] = True
        else:
            self._timeline.observe(now_ms, status)
            self._last_status = status
            snapshot["error"] = ""
            snapshot["stale"] = False
            snapshot["master_id"] = status.master_id
            snapshot["epoch"] = status.epoch
            snapshot["replicas"] = replica_rows(status)
            explained = cli_explain.explain(status)
            snapshot["explain"] = {
                "master": explained["master"],
                "if_failed": explained["if_failed"],
                "notes": cli_explain.notes(status),
            }
            snapshot.update(self._poll_topics(now_ms))
        snapshot["timeline"] = [e.to_dict() for e in reversed(self._timeline.entries(now_ms))]
        with self._changed:
            self._snapshot = snapshot
            self._version += 1
            self._changed.notify_all()
        return snapshot

    def _snapshot_data_only(self) -> dict[str, Any]:
        keep = ("master_id", "epoch", "replicas", "explain", "topics", "subscriptions", "push")
        return {k: self._snapshot[k] for k in keep if k in self._snapshot}

    def _poll_topics(self, now_ms: int) -> dict[str, Any]:
        try:
            infos = self._client.topics()
        except squall.SquallError as err:
            return {"topics_error": f"topics: {err}", "topics": [], "subscriptions": [], "push": []}
        topics, subscriptions, pushes = [], [], []
        keys: set[str] = set()
        for index, info in enumerate(infos):
            consumed: int | None = None
            if index < TOPICS_DETAIL_MAX:
                topic = self._topic_handle(info)
                consumed = 0
                try:
                    for sub in topic.subscription_infos():
                        consumed += sub.cursor
                        subscriptions.append(
                            {
                                "topic": info.name,
                                "name": sub.name,
                                "cursor": sub.cursor,
                                "backlog": sub.backlog,
                                "shared": sub.shared,
                                "outstanding": sub.outstanding,
                                "dead_lettered": sub.dead_lettered,
                            }
                        )
                    for push in topic.push_subscribers():
                        consumed += push.cursor
                        pushes.append(
                            {
                                "topic": info.name,
                                "subscriber_id": push.subscriber_id,
                                "endpoint": push.endpoint,
                                "cursor": push.cursor,
                                "reliability": push.qos.get("reliability", ""),
                                "failures": push.consecutive_failures,
                                "last_error": push.last_error,
                            }
                        )
                except squall.NotFound:
                    continue  # destroyed between the listing and now
                except squall.SquallError:
                    consumed = None
            publish_key, consume_key = f"p:{info.name}", f"c:{info.name}"
            keys.update((publish_key, consume_key))
            topics.append(
                {
                    "name": info.name,
                    "kind": info.kind,
                    "events": info.next_offset - info.first_offset,
                    "first_offset": info.first_offset,
                    "next_offset": info.next_offset,
                    # None (shown n/a) when the replica does not count it (docs/console.md).
                    "size_bytes": info.size_bytes,
                    "publish_rate": self._rates.sample(publish_key, now_ms, info.next_offset),
                    "consume_rate": (
                        self._rates.sample(consume_key, now_ms, consumed)
                        if consumed is not None
                        else None
                    ),
                }
            )
        self._rates.forget_except(keys)
        return {"topics": topics, "subscriptions": subscriptions, "push": pushes}

    def snapshot(self) -> tuple[int, dict[str, Any]]:
        """The last snapshot and its version."""
        with self._changed:
            return self._version, self._snapshot

    def wait_newer(self, version: int, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
        """The first snapshot newer than `version`, or None after timeout_s."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._version > version, timeout=timeout_s):
                return None
            return self._version, self._snapshot

    def run_poller(self, stop: threading.Event) -> None:
        """Polls every poll_interval_ms until stop is set (a thread's target)."""
        while not stop.is_set():
            started = self._clock.monotonic_ms()
            self.poll()
            spent_ms = self._clock.monotonic_ms() - started
            stop.wait(max(0, self.poll_interval_ms - spent_ms) / 1000)

    # -- the topic view -------------------------------------------------------------------

    def _topic(self, name: str) -> squall.Topic:
        check_topic_name(name)
        try:
            return self._client.topic(name)
        except squall.SquallError as err:
            raise from_squall(err, f"topic {name!r}") from None

    def recent_events(self, name: str, start: str = "", count: str = "") -> dict[str, Any]:
        """Events of a topic from offset `start` (empty: the last `count` events)."""
        number = (
            _parse_int(count, "count", 1, RECENT_EVENTS_MAX) if count else RECENT_EVENTS_DEFAULT
        )
        offset = _parse_int(start, "offset", 0) if start else None
        topic = self._topic(name)
        info = topic.info
        document: dict[str, Any] = {
            "topic": info.name,
            "kind": info.kind,
            "first_offset": info.first_offset,
            "next_offset": info.next_offset,
            "events": [],
        }
        if info.kind == "transient":
            document["note"] = "a transient topic stores no events: there is nothing to read back"
            return document
        if offset is None:
            offset = max(info.first_offset, info.next_offset - number)
        end = min(offset + number, info.next_offset)
        if offset >= end:
            document["note"] = f"no events from offset {offset} (the next offset is {end})"
            return document
        try:
            with topic.subscribe(None, start=offset, follow=False, end_offset=end) as sub:
                document["events"] = [message_document(m) for m in sub]
        except squall.SquallError as err:
            raise from_squall(err, f"reading topic {name!r} from offset {offset}") from None
        return document

    def publish(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Publishes one test event; the receipt, or the gateway's refusal (nothing stored)."""
        payload, key, headers = decode_payload(body)
        topic = self._topic(name)
        try:
            with topic.publisher() as publisher:
                receipt = publisher.publish(payload, key, headers or None)
        except squall.SquallError as err:
            raise from_squall(err, f"publishing to topic {name!r}") from None
        return {
            "topic": name,
            "offset": receipt.offset,
            "lsn": receipt.lsn,
            "epoch": receipt.epoch,
            "master_id": receipt.master_id,
            "duplicate": receipt.duplicate,
        }

    # -- operator actions -----------------------------------------------------------------

    def action(self, body: dict[str, Any]) -> dict[str, Any]:
        """Transfer, quarantine or unquarantine through `squall cluster`'s own code (the
        coordinators' audit trail records the operator and reason). The request must repeat
        the node id in `confirm`: the page asks the person to confirm first."""
        kind = body.get("action")
        node = body.get("node")
        reason = body.get("reason") or ""
        if kind not in ACTIONS:
            raise ConsoleError(400, f"action must be one of {', '.join(ACTIONS)}, not {kind!r}")
        if not isinstance(node, str) or not isinstance(reason, str):
            raise ConsoleError(400, "node and reason must be strings")
        try:
            validate_node_id(node)
        except ValueError as err:
            raise ConsoleError(400, str(err)) from None
        if body.get("confirm") != node:
            raise ConsoleError(
                400, f"not confirmed: repeat the node id ({node}) in 'confirm' to {kind} it"
            )
        if self._config_path is None:
            raise ConsoleError(
                409,
                "operator actions need the cluster file (start the console with --config "
                "FILE, as `squall cluster` needs it to reach the coordinators)",
            )
        if self._last_status is not None and node not in {
            n.node_id for n in self._last_status.nodes
        }:
            raise ConsoleError(404, f"no node {node!r} in the cluster")
        args = argparse.Namespace(
            cluster_command=kind,
            config=self._config_path,
            node=node,
            target=node,
            reason=f"console: {reason}" if reason else "console",
            timeout=ACTION_TIMEOUT_S,
            wait_ms=TRANSFER_WAIT_MS,
        )
        out = io.StringIO()
        try:
            self._run_admin(args, out)
        except cli_admin.AdminError as err:
            raise ConsoleError(502, f"{kind} {node}: {err}") from None
        text = out.getvalue().strip()
        self._timeline.note(self._clock.wall_ms(), "operator", f"console: {kind} {node}: {text}")
        return {"action": kind, "node": node, "result": text}
