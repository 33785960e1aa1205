"""The cluster configuration: one TOML file, read into frozen dataclasses and validated.

Every service reads the same file (``--config FILE``) before it starts anything. Reading
has two layers: the TOML layer checks the file's shape (sections, unknown keys, required
keys, string enums, paths), then ``ClusterConfig.validate()`` checks every value and every
cross-field rule, as etcd-raft's ``Config.validate()`` does. Each failure is one
``ConfigError`` sentence naming the field path (``nodes[1].priority``) and the bad value.
Configs built in code (tests, the simulator) call ``validate()`` themselves.

The keys, defaults and units are documented in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from squall.v1 import common_pb2
from squall.wire.retry import POLICY_BOUNDS as RETRY_POLICY_BOUNDS
from squall.wire.retry import (
    RETRY_ATTEMPTS_MAX_DEFAULT,
    RETRY_BACKOFF_INITIAL_MS_DEFAULT,
    RETRY_BACKOFF_MAX_MS_DEFAULT,
    RETRY_TOTAL_MS_MAX_DEFAULT,
    RetryPolicy,
)
from squall_server.common.auth_config import AuthConfig, build_auth, require_tls, validate_auth
from squall_server.common.names import (
    PUBLISHER_ID_MAX_BYTES,
    SUBSCRIPTION_NAME_MAX_BYTES,
    TOPIC_NAME_MAX_BYTES,
    validate_node_id,
)

MiB = 1024 * 1024

# Bounds on the configuration itself ("put a limit on everything").
NODES_MAX = 64
GATEWAYS_MAX = 64
PRIORITY_MAX = 1000
# gRPC message sizes are signed 32-bit.
GRPC_MESSAGE_BYTES_MAX = 2**31 - 1
# Longest part of a bad value quoted back in an error.
_SHOWN_CHARS_MAX = 80

# Configuration file strings for the durability enums (matched case-insensitively).
SYNC_POLICY_NAMES: Mapping[str, common_pb2.SyncPolicy.ValueType] = {
    "SYNC": common_pb2.SYNC_POLICY_SYNC,
    "WRITE_NO_SYNC": common_pb2.SYNC_POLICY_WRITE_NO_SYNC,
    "NO_SYNC": common_pb2.SYNC_POLICY_NO_SYNC,
}
# "all" stays first for ACK_POLICY_ALL: it is the name the agreed-settings digest uses, so
# nodes of this version and older ones agree (ClusterConfig.agreed_settings).
ACK_POLICY_NAMES: Mapping[str, common_pb2.AckPolicy.ValueType] = {
    "majority": common_pb2.ACK_POLICY_MAJORITY,
    "all": common_pb2.ACK_POLICY_ALL,
    "none": common_pb2.ACK_POLICY_NONE,
    "group": common_pb2.ACK_POLICY_ALL,
}
# Names that still load but say less than they seem to (issue 20): what each does, and
# the name to write instead.
DEPRECATED_ACKS = {
    "all": (
        'durability.acks = "all" is deprecated: it waits for every member of the current '
        "group, not every configured node (a node out of the group is not waited for); "
        'write acks = "group"'
    ),
}
DEPRECATED_MASTER_SYNC = {
    "NO_SYNC": (
        'durability.master_sync = "NO_SYNC" is deprecated: a master must write an entry to '
        "its log before it can replicate it, so it behaves as WRITE_NO_SYNC (and is loaded "
        'as that); write master_sync = "WRITE_NO_SYNC"'
    ),
}
TELEMETRY_EXPORTERS = ("none", "console", "otlp", "prometheus")
# Bind-only addresses (the Prometheus endpoint) may listen on every interface.
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


class ConfigError(Exception):
    """A configuration problem; str(error) is the one line to show the operator."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path


@dataclass(frozen=True)
class NodeConfig:
    """One node: a coordinator and a replica sharing an id, a priority and a store."""

    id: str
    priority: int
    coordinator_address: str
    replica_address: str
    data_dir: Path
    # A learner (a node added or replaced at runtime that has not caught up yet): it gets
    # the log but does not vote; `squall cluster config export` writes it, hand-written
    # files leave it out.
    learner: bool = False


@dataclass(frozen=True)
class GatewayConfig:
    """One stateless gateway."""

    id: str
    address: str
    # Where it forwards a Subscribe that does not say (READ_FROM_UNSPECIFIED): "master",
    # or "replicas" (spread over the master's group, docs/consumers.md).
    read_from: str = "master"


@dataclass(frozen=True)
class TimeoutsConfig:
    """Election, membership and RPC timing, in milliseconds.

    The defaults detect a failed node 0.3-0.4 s after it fails (member_timeout_ms from its
    last answer) and, when it was the master, have the next node in rank invite the others
    at once (about 0.4-0.5 s in all on a LAN; docs/configuration.md).
    """

    heartbeat_interval_ms: int = 100
    member_timeout_ms: int = 400
    probe_interval_ms: int = 200
    merge_delay_ms_per_priority: int = 50
    # One fate per node: a coordinator whose replica has not answered for this long takes
    # the node out of its group until the replica answers again (docs/configuration.md).
    replica_timeout_ms: int = 300
    # One fate per node, a stuck disk: a replica whose oldest store write (commit and
    # flush) has run this long counts as not answering. Far above a busy disk's slowest
    # fsync, so a slow but working disk does not fail over (docs/configuration.md).
    store_stall_timeout_ms: int = 2000
    rpc_timeout_ms: int = 2000
    publish_timeout_ms: int = 10000
    # Push subscribers (docs/push-subscribers.md): one Deliver call's deadline, and the
    # backoff between failed deliveries (doubling from initial to max, jittered).
    push_deliver_timeout_ms: int = 5000
    push_retry_backoff_initial_ms: int = 100
    push_retry_backoff_max_ms: int = 5000
    # Test-only: a replica serving a reorganization snapshot waits this long before each
    # chunk, so tests can make a sync outlast rpc_timeout_ms. 0 (no wait) in production.
    snapshot_chunk_delay_ms: int = 0


@dataclass(frozen=True)
class RetryConfig:
    """How the gateway retries indeterminate calls (the client library takes the same names).

    The defaults are the client library's (`squall.RetryPolicy`), so an app and the
    gateway retry alike unless configured otherwise. The budget is time
    (`retry_total_ms_max`); `retry_attempts_max` is an optional cap (0: none, 1: no retry).
    """

    retry_attempts_max: int = RETRY_ATTEMPTS_MAX_DEFAULT
    retry_backoff_initial_ms: int = RETRY_BACKOFF_INITIAL_MS_DEFAULT
    retry_backoff_max_ms: int = RETRY_BACKOFF_MAX_MS_DEFAULT
    retry_total_ms_max: int = RETRY_TOTAL_MS_MAX_DEFAULT

    def policy(self) -> RetryPolicy:
        """The section as the shared retry policy."""
        return RetryPolicy(
            attempts_max=self.retry_attempts_max,
            backoff_initial_ms=self.retry_backoff_initial_ms,
            backoff_max_ms=self.retry_backoff_max_ms,
            total_ms_max=self.retry_total_ms_max,
        )


@dataclass(frozen=True)
class LimitsConfig:
    """Sizes and counts every service enforces, validated at start-up."""

    max_event_bytes: int = 1 * MiB
    max_batch_events: int = 10000
    max_batch_bytes: int = 16 * MiB
    max_message_bytes: int = 32 * MiB
    map_size_bytes: int = 1024 * MiB
    dedupe_window: int = 100000
    max_topics: int = 10000
    commit_batch_max_entries: int = 256
    subscribe_batch_max_events: int = 1000
    # Encoded event bytes per Subscribe response when the request does not set
    # max_batch_bytes: under gRPC's default 4 MiB receive limit, so a client in any language
    # reads with default channel options. A request may ask for up to max_batch_bytes, which
    # also caps this (so a cluster with a smaller max_batch_bytes needs no change here).
    subscribe_batch_default_bytes: int = 3 * MiB
    log_retention_entries: int = 1000000
    replication_inflight_entries_max: int = 1024
    replication_inflight_bytes_max: int = 8 * MiB
    replication_pending_writes_max: int = 65536
    # Push subscribers: events and bytes per Deliver call, Deliver calls in flight to one
    # unordered subscriber, and subscribers per topic.
    push_batch_max_events: int = 500
    push_batch_max_bytes: int = 3 * MiB
    push_inflight_batches_max: int = 4
    push_subscribers_max: int = 1000
    # Per client (docs/configuration.md#per-client-limits): streams open at once, publish
    # requests awaiting their receipts, and the size of a call's metadata.
    client_streams_max: int = 100
    client_inflight_publishes_max: int = 1000
    metadata_bytes_max: int = 16384
    # Durable subscriptions per topic.
    topic_subscriptions_max: int = 10000

    # Longest names a client may create: topics, durable subscriptions and push
    # subscriber ids, publisher ids. At most the name grammar's maxima (names.py), so a
    # cluster can only be stricter than the grammar, never accept a name another refuses.
    max_topic_name_bytes: int = TOPIC_NAME_MAX_BYTES
    max_subscription_name_bytes: int = SUBSCRIPTION_NAME_MAX_BYTES
    max_publisher_id_bytes: int = PUBLISHER_ID_MAX_BYTES


@dataclass(frozen=True)
class DurabilityConfig:
    """Sync policies (common_pb2.SyncPolicy) and the ack count (common_pb2.AckPolicy)."""

    master_sync: common_pb2.SyncPolicy.ValueType = common_pb2.SYNC_POLICY_SYNC
    replica_sync: common_pb2.SyncPolicy.ValueType = common_pb2.SYNC_POLICY_WRITE_NO_SYNC
    acks: common_pb2.AckPolicy.ValueType = common_pb2.ACK_POLICY_MAJORITY


@dataclass(frozen=True)
class TelemetryConfig:
    """Where traces and metrics go (docs/observability.md).

    One file serves every service, and a node's coordinator and replica share a host, so
    each kind of service has its own Prometheus port; 0 picks a free port and logs it.
    """

    exporter: str = "none"
    otlp_endpoint: str = ""
    prometheus_host: str = "127.0.0.1"
    coordinator_prometheus_port: int = 0
    replica_prometheus_port: int = 0
    gateway_prometheus_port: int = 0
    trace_sample_ratio: float = 1.0
    metrics_interval_ms: int = 10000

    def prometheus_port(self, service: str) -> int:
        """The scrape port of one kind of service (coordinator, replica or gateway)."""
        port: int = getattr(self, f"{service}_prometheus_port")
        return port


@dataclass(frozen=True)
class LogConfig:
    """Log level and line format."""

    level: str = "INFO"
    format: str = "text"


@dataclass(frozen=True)
class ConsoleConfig:
    """[console]: one gateway also serves the web console (docs/console.md)."""

    enabled: bool = False
    # The id of the gateway that serves it; empty: the first [[gateways]] entry.
    gateway: str = ""
    # host:port of the page; a non-loopback address needs token_file.
    address: str = "127.0.0.1:7180"
    # The token the console sends to its gateway and asks of every browser.
    token_file: Path | None = None
    poll_interval_ms: int = 1000


# The fastest and slowest status polling a console takes (the page asks for <= 2 s).
CONSOLE_POLL_MS_MIN = 200
CONSOLE_POLL_MS_MAX = 10_000


def is_loopback_host(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (brackets allowed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsConfig:
    """Transport security (docs/security.md): the cluster CA and the per-identity certificates.

    cert_dir holds `<id>.crt` and `<id>.key` for every node and gateway id (and `admin.crt`
    / `admin.key` for the CLI); a host needs only its own.
    """

    enabled: bool = False
    ca_file: Path | None = None
    cert_dir: Path | None = None
    # Push deliveries (the master dialling an app's PushSubscriber endpoint): "tls" (the
    # endpoint's certificate verified against push_ca_file, default ca_file, for the
    # endpoint's host; the replica presents its own certificate) or "plaintext".
    push: str = "tls"
    push_ca_file: Path | None = None

    @property
    def push_tls(self) -> bool:
        """Whether a master reaches push endpoints over TLS."""
        return self.enabled and self.push == "tls"


@dataclass(frozen=True)
class RemoteConfig:
    """Another Squall cluster this one's topics may link to (docs/federation.md).

    Reached through its gateways: over TLS when ca_file is set (its gateways' certificates
    verified against that CA, for server_name when given, else each address's host), with
    the token in token_file when set (the remote's [auth]).
    """

    name: str
    gateways: tuple[str, ...]
    ca_file: Path | None = None
    server_name: str = ""
    token_file: Path | None = None


@dataclass(frozen=True)
class ClusterConfig:
    """The whole cluster as every service sees it."""

    name: str
    nodes: tuple[NodeConfig, ...]
    gateways: tuple[GatewayConfig, ...]
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    durability: DurabilityConfig = field(default_factory=DurabilityConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    logging: LogConfig = field(default_factory=LogConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    path: Path = Path("<memory>")
    tls: TlsConfig = field(default_factory=TlsConfig)
    # Deprecated names the file used, one sentence each (logged as warnings at start).
    deprecations: tuple[str, ...] = field(default=(), compare=False)
    remotes: tuple[RemoteConfig, ...] = ()
    console: ConsoleConfig = field(default_factory=ConsoleConfig)

    def remote(self, name: str) -> RemoteConfig | None:
        """The [[remotes]] entry of that name, or None."""
        return next((r for r in self.remotes if r.name == name), None)

    # The version and epoch of the node set listed, as `squall cluster config export`
    # writes them (0 for a file written by hand): a node started from an exported file
    # never takes an older running node set for newer (docs/operations.md, "Changing the
    # membership").
    membership_version: int = 0
    membership_epoch: int = 0

    def node(self, node_id: str) -> NodeConfig:
        """The node with this id; ConfigError listing the configured ids if there is none."""
        for node in self.nodes:
            if node.id == node_id:
                return node
        configured = ", ".join(node.id for node in self.nodes)
        raise ConfigError(f"unknown node id {_show(node_id)}; configured: {configured}")

    def gateway(self, gateway_id: str | None = None) -> GatewayConfig:
        """The gateway with this id, or the first listed gateway when gateway_id is None."""
        if gateway_id is None:
            if not self.gateways:
                raise ConfigError("no gateway is configured")
            return self.gateways[0]
        for gateway in self.gateways:
            if gateway.id == gateway_id:
                return gateway
        configured = ", ".join(gateway.id for gateway in self.gateways)
        raise ConfigError(f"unknown gateway id {_show(gateway_id)}; configured: {configured}")

    @property
    def majority(self) -> int:
        """The smallest count of nodes that is more than half of all configured nodes."""
        return len(self.nodes) // 2 + 1

    def validate(self) -> None:
        """Raise ConfigError for the first value or combination of values that is wrong."""
        _validate_cluster(self)

    def agreed_settings(self) -> tuple[tuple[str, str], ...]:
        """The settings every member must share, as (dotted key, value) pairs.

        Members compare them when they form a group and refuse a node that differs
        (squall_server.coordinator.agreement; docs/operations.md, "Consistency at start").
        In: the cluster name; every node's id, priority and addresses (the election and
        the replication streams dial them, and a priority decides who leads); the acks
        policy and both sync policies (any node may become master or slave, so the
        guarantee read from the file must hold whichever node leads); and the limits that
        shape stored, replicated data — an event's and a message's size (a slave must
        take every entry its master writes), the dedupe window (a new master with a
        smaller one would apply a retried publish twice), the counts of topics,
        subscriptions and push subscribers and the longest names (a new master must not
        hold more, or longer, than it accepts). Out: data_dir and map_size_bytes (each
        host's disk), timeouts, retry, batching and flow-control limits, per-client
        limits, log retention, telemetry, logging, TLS and auth (local tuning, which may
        differ during a rolling change; a TLS mismatch fails the connection first), and
        the gateways (stateless, not members).
        """
        settings: list[tuple[str, str]] = [("cluster.name", self.name)]
        for node in sorted(self.nodes, key=lambda n: n.id):
            settings.append(
                (
                    f"nodes.{node.id}",
                    f"priority={node.priority} coordinator={node.coordinator_address} "
                    f"replica={node.replica_address}" + (" learner" if node.learner else ""),
                )
            )
        durability = self.durability
        settings += [
            ("durability.acks", _enum_name(ACK_POLICY_NAMES, durability.acks)),
            ("durability.master_sync", _enum_name(SYNC_POLICY_NAMES, durability.master_sync)),
            ("durability.replica_sync", _enum_name(SYNC_POLICY_NAMES, durability.replica_sync)),
        ]
        limits = self.limits
        for key in _AGREED_LIMITS:
            settings.append((f"limits.{key}", str(getattr(limits, key))))
        return tuple(settings)


# The [limits] keys members must share (ClusterConfig.agreed_settings says why).
_AGREED_LIMITS = (
    "max_event_bytes",
    "max_message_bytes",
    "dedupe_window",
    "max_topics",
    "topic_subscriptions_max",
    "push_subscribers_max",
    "max_topic_name_bytes",
    "max_subscription_name_bytes",
    "max_publisher_id_bytes",
)


def _enum_name(names: Mapping[str, int], value: int) -> str:
    """The configuration file's name for an enum value (the number if it has none)."""
    for name, number in names.items():
        if number == value:
            return name
    return str(value)


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read, parse and validate the configuration file at path."""
    config_path = Path(path)
    try:
        data = config_path.read_bytes()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f"cannot read the file: {reason}", config_path) from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError(f"the file is not valid UTF-8 (line {line})", config_path) from error
    return parse_config(text, config_path)


def parse_config(text: str, path: str | os.PathLike[str]) -> ClusterConfig:
    """Parse and validate configuration text; relative data_dirs resolve against path's dir."""
    config_path = Path(path)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"invalid TOML: {error}", config_path) from error
    try:
        config = _build(document, config_path)
        config.validate()
    except ConfigError as error:
        raise ConfigError(error.message, config_path) from None
    return config


def load_config_or_exit(
    path: str | os.PathLike[str],
    *,
    node_id: str | None = None,
    gateway_id: str | None = None,
) -> ClusterConfig:
    """load_config, or print one line to stderr and exit with status 2.

    With node_id (or gateway_id) given, an id missing from the file is reported the same way.
    """
    try:
        config = load_config(path)
        if node_id is not None:
            config.node(node_id)
        if gateway_id is not None:
            config.gateway(gateway_id)
        # A service checks its own certificate before it starts (the file is shared, but
        # each host holds only its own key).
        identity = node_id if node_id is not None else gateway_id
        if config.tls.enabled and identity is not None:
            check_tls_identity(config.tls, identity)
    except ConfigError as error:
        _exit_with_error(path, error.message)
    for deprecation in config.deprecations:
        print(f"squall: config warning: {os.fspath(path)}: {deprecation}", file=sys.stderr)
    return config


def _exit_with_error(path: str | os.PathLike[str], message: str) -> NoReturn:
    """Print the one-line config error and exit 2 (the usage-error status)."""
    one_line = " ".join(message.splitlines())
    print(f"squall: config error: {os.fspath(path)}: {one_line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# --------------------------------------------------------------------------- TOML layer

_SECTIONS: Mapping[str, str] = {
    "cluster": "table",
    "nodes": "array",
    "gateways": "array",
    "timeouts": "table",
    "retry": "table",
    "limits": "table",
    "durability": "table",
    "telemetry": "table",
    "logging": "table",
    "tls": "table",
    "auth": "table",
    "remotes": "array",
    "console": "table",
}
_CLUSTER_KEYS = ("name", "membership_version", "membership_epoch")
_NODE_KEYS = tuple(f.name for f in dataclasses.fields(NodeConfig))
_NODE_REQUIRED_KEYS = tuple(k for k in _NODE_KEYS if k != "learner")
_GATEWAY_KEYS = tuple(f.name for f in dataclasses.fields(GatewayConfig))
_GATEWAY_REQUIRED_KEYS = ("id", "address")
GATEWAY_READ_FROM = ("master", "replicas")
# Keys that look configurable but are fixed elsewhere, with the reason given instead of
# "unknown key".
_FIXED_KEYS: Mapping[tuple[str, str], str] = {
    ("telemetry", "prometheus_address"): (
        "was replaced by prometheus_host and one port per service (coordinator_prometheus_port, "
        "replica_prometheus_port, gateway_prometheus_port; see docs/configuration.md)"
    ),
}


def _build(document: Mapping[str, Any], config_path: Path) -> ClusterConfig:
    """Turn the parsed TOML document into a ClusterConfig, checking its shape only."""
    for key, value in document.items():
        if key not in _SECTIONS:
            raise ConfigError(_unknown_top_level(key, value))
    for section, shape in _SECTIONS.items():
        if section in document:
            _check_shape(section, document[section], shape)

    if "cluster" not in document:
        raise ConfigError("missing section [cluster]; it holds the required key 'name'")
    cluster = document["cluster"]
    _check_keys(cluster, _CLUSTER_KEYS, "[cluster]", "cluster")
    _require(cluster, "name", "cluster.name")

    base_dir = config_path.absolute().parent
    deprecations: list[str] = []
    nodes = tuple(
        _build_node(index, entry, base_dir) for index, entry in enumerate(document.get("nodes", []))
    )
    gateways = tuple(
        _build_gateway(index, entry) for index, entry in enumerate(document.get("gateways", []))
    )
    set_key: dict[str, int] = {}
    for key in ("membership_version", "membership_epoch"):
        value = cluster.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"cluster.{key}: must be a non-negative integer (written by squall cluster "
                f"config export), got {_show(value)}"
            )
        set_key[key] = value
    return ClusterConfig(
        name=cluster["name"],
        nodes=nodes,
        **set_key,
        gateways=gateways,
        timeouts=_build_plain(document, "timeouts", TimeoutsConfig),
        retry=_build_plain(document, "retry", RetryConfig),
        limits=_build_plain(document, "limits", LimitsConfig),
        durability=_build_durability(document.get("durability", {}), deprecations),
        telemetry=_build_plain(
            document, "telemetry", TelemetryConfig, choices={"exporter": TELEMETRY_EXPORTERS}
        ),
        logging=_build_plain(
            document, "logging", LogConfig, choices={"level": LOG_LEVELS, "format": LOG_FORMATS}
        ),
        auth=_build_auth(document.get("auth", {})),
        path=config_path.absolute(),
        tls=_build_tls(document.get("tls", {}), base_dir),
        deprecations=tuple(deprecations),
        remotes=tuple(
            _build_remote(index, entry, base_dir)
            for index, entry in enumerate(document.get("remotes", []))
        ),
        console=_build_console(document, gateways, base_dir),
    )


def _build_console(
    document: Mapping[str, Any], gateways: tuple[GatewayConfig, ...], base_dir: Path
) -> ConsoleConfig:
    """[console]: which gateway serves the page, where, with which token."""
    table = document.get("console", {})
    known = [f.name for f in dataclasses.fields(ConsoleConfig)]
    _check_keys(table, known, "[console]", "console")
    enabled = table.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"console.enabled: must be true or false, got {_describe(enabled)}")
    gateway = table.get("gateway", "")
    if not isinstance(gateway, str):
        raise ConfigError(f"console.gateway: must be a gateway id, got {_describe(gateway)}")
    if gateway and gateway not in {g.id for g in gateways}:
        listed = ", ".join(g.id for g in gateways)
        raise ConfigError(f"console.gateway: no gateway {_show(gateway)}; configured: {listed}")
    address = table.get("address", ConsoleConfig.address)
    if not isinstance(address, str):
        raise ConfigError(f"console.address: must be a host:port string, got {_describe(address)}")
    try:
        host, _ = parse_address(address)
    except ValueError as error:
        raise ConfigError(f"console.address: {_show(address)}: {error}") from None
    token_file = (
        _resolve_dir(table["token_file"], "console.token_file", base_dir)
        if "token_file" in table
        else None
    )
    if enabled and token_file is None and not is_loopback_host(host):
        raise ConfigError(
            f"console.address: {_show(address)} is not a loopback address: set "
            "console.token_file so the page asks for a token, or serve it on 127.0.0.1"
        )
    auth = document.get("auth", {})
    if enabled and token_file is None and isinstance(auth, dict) and auth.get("enabled"):
        raise ConfigError(
            "console.token_file: required when [auth] is on (the console calls its gateway "
            "with the token of an admin principal)"
        )
    poll = table.get("poll_interval_ms", ConsoleConfig.poll_interval_ms)
    if (
        not isinstance(poll, int)
        or isinstance(poll, bool)
        or not CONSOLE_POLL_MS_MIN <= poll <= CONSOLE_POLL_MS_MAX
    ):
        raise ConfigError(
            f"console.poll_interval_ms: must be an integer from {CONSOLE_POLL_MS_MIN} to "
            f"{CONSOLE_POLL_MS_MAX}, got {_show(poll)}"
        )
    return ConsoleConfig(
        enabled=enabled,
        gateway=gateway,
        address=address,
        token_file=token_file,
        poll_interval_ms=poll,
    )


def _build_remote(index: int, table: Mapping[str, Any], base_dir: Path) -> RemoteConfig:
    """One [[remotes]] entry; paths resolve against the config file's directory."""
    where = f"remotes[{index}]"
    known = [f.name for f in dataclasses.fields(RemoteConfig)]
    _check_keys(table, known, f"[[remotes]] entry {index}", "remotes")
    _require(table, "name", f"{where}.name")
    _require(table, "gateways", f"{where}.gateways")
    name = table["name"]
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: must be a string, got {_describe(name)}")
    _check_id(name, f"{where}.name", "cluster name")
    gateways = table["gateways"]
    if (
        not isinstance(gateways, list)
        or not gateways
        or not all(isinstance(g, str) for g in gateways)
    ):
        raise ConfigError(
            f'{where}.gateways: must be a non-empty list of "host:port" strings, '
            f"got {_describe(gateways)}"
        )
    for address in gateways:
        try:
            parse_address(address)
        except ValueError as error:
            raise ConfigError(f"{where}.gateways: {_show(address)}: {error}") from None
    server_name = table.get("server_name", "")
    if not isinstance(server_name, str):
        raise ConfigError(f"{where}.server_name: must be a string, got {_describe(server_name)}")
    paths: dict[str, Path | None] = {}
    for key in ("ca_file", "token_file"):
        paths[key] = _resolve_dir(table[key], f"{where}.{key}", base_dir) if key in table else None
    return RemoteConfig(
        name=name,
        gateways=tuple(gateways),
        ca_file=paths["ca_file"],
        server_name=server_name,
        token_file=paths["token_file"],
    )


def _unknown_top_level(key: str, value: object) -> str:
    """The message for a top-level key that is not one of the sections."""
    matches = difflib.get_close_matches(key, list(_SECTIONS), n=1, cutoff=0.6)
    hint = ""
    if matches:
        brackets = "[[{}]]" if _SECTIONS[matches[0]] == "array" else "[{}]"
        hint = "; did you mean " + brackets.format(matches[0]) + "?"
    if isinstance(value, dict):
        return f"unknown section [{key}]{hint}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return f"unknown section [[{key}]]{hint}"
    return (
        f"unknown top-level key {_show(key)} = {_show(value)}; "
        f"keys belong in a section such as [cluster]{hint}"
    )


def _check_shape(section: str, value: object, shape: str) -> None:
    """Check a section is a table ([x]) or an array of tables ([[x]])."""
    if shape == "table":
        if not isinstance(value, dict):
            raise ConfigError(
                f"{section}: must be a table written [{section}], got {_describe(value)}"
            )
        return
    if not isinstance(value, list):
        raise ConfigError(
            f"{section}: must be an array of tables written [[{section}]], got {_describe(value)}"
        )
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{section}[{index}]: must be a table written [[{section}]], got {_describe(entry)}"
            )


def _check_keys(table: Mapping[str, Any], known: Sequence[str], where: str, section: str) -> None:
    """Reject any key of table that is not in known, suggesting the closest known key."""
    for key in table:
        if key in known:
            continue
        fixed = _FIXED_KEYS.get((section, key))
        if fixed is not None:
            raise ConfigError(f"{section}.{key}: {fixed}")
        raise ConfigError(f"unknown key {_show(key)} in {where}{_did_you_mean(key, known)}")


def _require(table: Mapping[str, Any], key: str, field_name: str) -> None:
    """Raise if a required key is missing."""
    if key not in table:
        raise ConfigError(f"{field_name}: required key is missing")


def _did_you_mean(key: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    """'; did you mean 'x'?' for a near miss, else ''."""
    matches = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {_show(matches[0])}?" if matches else ""


def _build_node(index: int, entry: Mapping[str, Any], base_dir: Path) -> NodeConfig:
    """One [[nodes]] entry; data_dir becomes an absolute path."""
    label = _label("node", entry.get("id"))
    _check_keys(entry, _NODE_KEYS, f"nodes[{index}]{label}", "nodes")
    for key in _NODE_REQUIRED_KEYS:
        _require(entry, key, f"nodes[{index}].{key}{label}")
    data_dir = _resolve_dir(entry["data_dir"], f"nodes[{index}].data_dir{label}", base_dir)
    learner = entry.get("learner", False)
    if not isinstance(learner, bool):
        raise ConfigError(
            f"nodes[{index}].learner{label}: must be true or false, got {_describe(learner)}"
        )
    return NodeConfig(
        id=entry["id"],
        priority=entry["priority"],
        coordinator_address=entry["coordinator_address"],
        replica_address=entry["replica_address"],
        data_dir=data_dir,
        learner=learner,
    )


def _build_gateway(index: int, entry: Mapping[str, Any]) -> GatewayConfig:
    """One [[gateways]] entry."""
    label = _label("gateway", entry.get("id"))
    _check_keys(entry, _GATEWAY_KEYS, f"gateways[{index}]{label}", "gateways")
    for key in _GATEWAY_REQUIRED_KEYS:
        _require(entry, key, f"gateways[{index}].{key}{label}")
    read_from = entry.get("read_from", "master")
    if read_from not in GATEWAY_READ_FROM:
        raise ConfigError(
            f"gateways[{index}].read_from{label}: must be one of "
            f"{', '.join(repr(v) for v in GATEWAY_READ_FROM)}, got {_show(read_from)}"
        )
    return GatewayConfig(id=entry["id"], address=entry["address"], read_from=read_from)


def _resolve_dir(value: object, field_name: str, base_dir: Path) -> Path:
    """A data_dir string as an absolute path; relative ones resolve against base_dir."""
    if not isinstance(value, str):
        raise ConfigError(f"{field_name}: must be a string, got {_describe(value)}")
    if not value.strip():
        raise ConfigError(f"{field_name}: must be a directory path, got {_show(value)}")
    if "\0" in value:
        raise ConfigError(f"{field_name}: must not contain a NUL character, got {_show(value)}")
    try:
        path = Path(value).expanduser()
    except RuntimeError as error:
        raise ConfigError(f"{field_name}: cannot expand '~' in {_show(value)}: {error}") from None
    if not path.is_absolute():
        path = base_dir / path
    try:
        return path.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop on 3.11
        raise ConfigError(f"{field_name}: cannot resolve {_show(value)}: {error}") from None


_T = TypeVar("_T")
_E = TypeVar("_E")


def _build_plain(
    document: Mapping[str, Any],
    section: str,
    cls: Callable[..., _T],
    *,
    choices: Mapping[str, Sequence[str]] | None = None,
) -> _T:
    """A section whose keys are the dataclass's fields; absent keys take the defaults."""
    table: Mapping[str, Any] = document.get(section, {})
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    _check_keys(table, known, f"[{section}]", section)
    values = dict(table)
    # Enum-like strings are matched case-insensitively and stored as spelled in choices;
    # anything else is kept as written so validate() can quote it back.
    for key, allowed in (choices or {}).items():
        value = values.get(key)
        if isinstance(value, str):
            values[key] = next((c for c in allowed if c.lower() == value.lower()), value)
    return cls(**values)


def _build_auth(table: Mapping[str, Any]) -> AuthConfig:
    """[auth] and its [[auth.principals]] (services/common/auth_config.py)."""
    try:
        return build_auth(table)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _build_durability(table: Mapping[str, Any], deprecations: list[str]) -> DurabilityConfig:
    """[durability], turning the policy strings into common_pb2 enum values; a deprecated
    name is loaded as what it does, with a sentence in deprecations."""
    known = [f.name for f in dataclasses.fields(DurabilityConfig)]
    _check_keys(table, known, "[durability]", "durability")
    defaults = DurabilityConfig()
    master_sync = defaults.master_sync
    replica_sync = defaults.replica_sync
    acks = defaults.acks
    if "master_sync" in table:
        master_sync = _parse_enum(table["master_sync"], "durability.master_sync", SYNC_POLICY_NAMES)
    if "replica_sync" in table:
        replica_sync = _parse_enum(
            table["replica_sync"], "durability.replica_sync", SYNC_POLICY_NAMES
        )
    if "acks" in table:
        acks = _parse_enum(table["acks"], "durability.acks", ACK_POLICY_NAMES)
        if isinstance(table["acks"], str) and table["acks"].lower() in DEPRECATED_ACKS:
            deprecations.append(DEPRECATED_ACKS[table["acks"].lower()])
    given = table.get("master_sync")
    if isinstance(given, str) and given.upper() in DEPRECATED_MASTER_SYNC:
        deprecations.append(DEPRECATED_MASTER_SYNC[given.upper()])
        master_sync = common_pb2.SYNC_POLICY_WRITE_NO_SYNC
    return DurabilityConfig(master_sync=master_sync, replica_sync=replica_sync, acks=acks)


# How a master reaches push endpoints with [tls] on (tls.push).
PUSH_TRANSPORTS = ("tls", "plaintext")


def _build_tls(table: Mapping[str, Any], base_dir: Path) -> TlsConfig:
    """[tls]; the paths resolve against the config file's directory, like data_dir."""
    known = [f.name for f in dataclasses.fields(TlsConfig)]
    _check_keys(table, known, "[tls]", "tls")
    enabled = table.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"tls.enabled: must be true or false, got {_describe(enabled)}")
    paths: dict[str, Path | None] = {}
    for key in ("ca_file", "cert_dir"):
        if key in table:
            paths[key] = _resolve_dir(table[key], f"tls.{key}", base_dir)
        elif enabled:
            raise ConfigError(f"tls.{key}: required key is missing (tls.enabled is true)")
        else:
            paths[key] = None
    push_ca_file = None
    if "push_ca_file" in table:
        push_ca_file = _resolve_dir(table["push_ca_file"], "tls.push_ca_file", base_dir)
    return TlsConfig(
        enabled=enabled,
        ca_file=paths["ca_file"],
        cert_dir=paths["cert_dir"],
        push=table.get("push", "tls"),  # checked by _validate_tls
        push_ca_file=push_ca_file,
    )


def _parse_enum(value: object, field_name: str, names: Mapping[str, _E]) -> _E:
    """Look a string up in names, ignoring case."""
    allowed = ", ".join(names)
    if not isinstance(value, str):
        raise ConfigError(f"{field_name}: must be one of {allowed}, got {_describe(value)}")
    for name, enum_value in names.items():
        if name.lower() == value.lower():
            return enum_value
    raise ConfigError(f"{field_name}: must be one of {allowed}, got {_show(value)}")


# --------------------------------------------------------------------------- validation


def _validate_cluster(config: ClusterConfig) -> None:
    """Every check of ClusterConfig.validate(), in the order an operator would fix them."""
    _check_id(config.name, "cluster.name", "cluster name")

    if not config.nodes:
        raise ConfigError("nodes: at least one [[nodes]] entry is required; none is configured")
    if len(config.nodes) > NODES_MAX:
        raise ConfigError(
            f"nodes: at most {NODES_MAX} nodes are supported, got {len(config.nodes)}"
        )
    if not config.gateways:
        raise ConfigError(
            "gateways: at least one [[gateways]] entry is required; none is configured"
        )
    if len(config.gateways) > GATEWAYS_MAX:
        raise ConfigError(
            f"gateways: at most {GATEWAYS_MAX} gateways are supported, got {len(config.gateways)}"
        )

    # Addresses are unique across every listener in the file: (host, port) -> owner field.
    listeners: dict[tuple[str, int], str] = {}
    node_ids: dict[str, str] = {}
    for index, node in enumerate(config.nodes):
        _validate_node(index, node, node_ids, listeners)
    gateway_ids: dict[str, str] = {}
    for index, gateway in enumerate(config.gateways):
        label = _label("gateway", gateway.id)
        id_field = f"gateways[{index}].id"
        _check_id(gateway.id, id_field, "gateway id")
        if gateway.id in gateway_ids:
            raise ConfigError(
                f"{id_field}: {_show(gateway.id)} is already the id of {gateway_ids[gateway.id]}"
            )
        gateway_ids[gateway.id] = f"gateways[{index}]"
        _claim_address(gateway.address, f"gateways[{index}].address{label}", listeners)
    _validate_data_dirs(config.nodes)
    remote_names: set[str] = set()
    for index, remote in enumerate(config.remotes):
        if remote.name == config.name:
            raise ConfigError(
                f"remotes[{index}].name: {_show(remote.name)} is this cluster's own name; "
                "a topic of this cluster links to another of its topics without a remote"
            )
        if remote.name in remote_names:
            raise ConfigError(f"remotes[{index}].name: {_show(remote.name)} is listed twice")
        remote_names.add(remote.name)

    if all(node.priority == 0 for node in config.nodes):
        raise ConfigError(
            "nodes[*].priority: every node has priority 0, so none can coordinate; "
            f"give at least one node a priority from 1 to {PRIORITY_MAX}"
        )

    _validate_timeouts(config.timeouts)
    _validate_retry(config.retry)
    _validate_limits(config.limits)
    _validate_durability(config.durability)
    _validate_telemetry(config.telemetry, listeners)
    _validate_logging(config.logging)
    _validate_tls(config.tls)
    try:
        validate_auth(config.auth)
        require_tls(config.auth.enabled, config.tls.enabled)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_tls(tls: TlsConfig) -> None:
    """With TLS on, both paths are set and enabled is a boolean.

    The files themselves are checked by the process that uses them
    (check_tls_identity): `squall certs dev` reads this file before they exist.
    """
    if not isinstance(tls.enabled, bool):
        raise ConfigError(f"tls.enabled: must be true or false, got {_describe(tls.enabled)}")
    if tls.push not in PUSH_TRANSPORTS:
        raise ConfigError(
            f"tls.push: must be one of {', '.join(map(repr, PUSH_TRANSPORTS))}, "
            f"got {_describe(tls.push)}"
        )
    if tls.enabled:
        tls_path(tls.ca_file, "tls.ca_file")
        tls_path(tls.cert_dir, "tls.cert_dir")
    elif tls.push_ca_file is not None:
        raise ConfigError("tls.push_ca_file: set, but tls.enabled is false (push is plaintext)")


def tls_path(path: Path | None, field_name: str) -> Path:
    """A [tls] path that must be set because TLS is on."""
    if path is None:
        raise ConfigError(f"{field_name}: required key is missing (tls.enabled is true)")
    return path


def check_tls_identity(tls: TlsConfig, identity: str) -> None:
    """ConfigError unless cert_dir holds a certificate and key for identity, from the CA."""
    from squall_server.common import tls_files  # cryptography is loaded only when TLS is on

    try:
        tls_files.check_dir(tls_path(tls.cert_dir, "tls.cert_dir"))
        tls_files.load_identity(
            tls_path(tls.ca_file, "tls.ca_file"), tls_path(tls.cert_dir, "tls.cert_dir"), identity
        )
        if tls.push_ca_file is not None:
            tls_files.read_ca(tls.push_ca_file, "tls.push_ca_file")
    except tls_files.TlsFileError as error:
        raise ConfigError(str(error)) from None


def _validate_node(
    index: int,
    node: NodeConfig,
    node_ids: dict[str, str],
    listeners: dict[tuple[str, int], str],
) -> None:
    """One node's id, priority and addresses."""
    label = _label("node", node.id)
    id_field = f"nodes[{index}].id"
    _check_id(node.id, id_field, "node id")
    if node.id in node_ids:
        raise ConfigError(f"{id_field}: {_show(node.id)} is already the id of {node_ids[node.id]}")
    node_ids[node.id] = f"nodes[{index}]"
    _check_int(node.priority, f"nodes[{index}].priority{label}", 0, PRIORITY_MAX)
    _claim_address(
        node.coordinator_address, f"nodes[{index}].coordinator_address{label}", listeners
    )
    _claim_address(node.replica_address, f"nodes[{index}].replica_address{label}", listeners)
    if not isinstance(node.data_dir, Path):
        raise ConfigError(
            f"nodes[{index}].data_dir{label}: must be a path, got {_describe(node.data_dir)}"
        )


def _validate_data_dirs(nodes: Sequence[NodeConfig]) -> None:
    """No two nodes share a data directory or nest one inside another."""
    for index, node in enumerate(nodes):
        for earlier_index, earlier in enumerate(nodes[:index]):
            field_name = f"nodes[{index}].data_dir{_label('node', node.id)}"
            owner = f"nodes[{earlier_index}]{_label('node', earlier.id)}"
            if node.data_dir == earlier.data_dir:
                raise ConfigError(
                    f"{field_name}: {_show(str(node.data_dir))} is already the data_dir of {owner}"
                )
            if earlier.data_dir in node.data_dir.parents:
                raise ConfigError(
                    f"{field_name}: {_show(str(node.data_dir))} is inside the data_dir of "
                    f"{owner}, {_show(str(earlier.data_dir))}"
                )
            if node.data_dir in earlier.data_dir.parents:
                raise ConfigError(
                    f"{field_name}: {_show(str(node.data_dir))} contains the data_dir of "
                    f"{owner}, {_show(str(earlier.data_dir))}"
                )


# (low, high) per key, in milliseconds.
_TIMEOUT_BOUNDS_MS: Mapping[str, tuple[int, int]] = {
    "heartbeat_interval_ms": (5, 60_000),
    "member_timeout_ms": (10, 600_000),
    "probe_interval_ms": (5, 600_000),
    "merge_delay_ms_per_priority": (0, 10_000),
    "replica_timeout_ms": (10, 600_000),
    "store_stall_timeout_ms": (100, 600_000),
    "rpc_timeout_ms": (10, 600_000),
    "publish_timeout_ms": (10, 3_600_000),
    "push_deliver_timeout_ms": (10, 600_000),
    "push_retry_backoff_initial_ms": (1, 600_000),
    "push_retry_backoff_max_ms": (1, 600_000),
    "snapshot_chunk_delay_ms": (0, 60_000),
}


def _validate_timeouts(timeouts: TimeoutsConfig) -> None:
    """Each timeout within its bounds; a member survives one lost heartbeat."""
    for key, (low, high) in _TIMEOUT_BOUNDS_MS.items():
        _check_int(getattr(timeouts, key), f"timeouts.{key}", low, high)
    if timeouts.member_timeout_ms < 2 * timeouts.heartbeat_interval_ms:
        raise ConfigError(
            f"timeouts.member_timeout_ms: must be at least twice timeouts.heartbeat_interval_ms "
            f"({timeouts.heartbeat_interval_ms}), so one lost heartbeat does not fail a member, "
            f"got {timeouts.member_timeout_ms}"
        )
    if timeouts.replica_timeout_ms < 2 * timeouts.heartbeat_interval_ms:
        raise ConfigError(
            f"timeouts.replica_timeout_ms: must be at least twice "
            f"timeouts.heartbeat_interval_ms ({timeouts.heartbeat_interval_ms}), so one slow "
            f"role renewal does not take the node out of its group, got "
            f"{timeouts.replica_timeout_ms}"
        )
    if timeouts.store_stall_timeout_ms < 2 * timeouts.heartbeat_interval_ms:
        raise ConfigError(
            f"timeouts.store_stall_timeout_ms: must be at least twice "
            f"timeouts.heartbeat_interval_ms ({timeouts.heartbeat_interval_ms}), the "
            f"interval at which the replica reports a stall, got "
            f"{timeouts.store_stall_timeout_ms}"
        )
    if timeouts.push_retry_backoff_initial_ms > timeouts.push_retry_backoff_max_ms:
        raise ConfigError(
            f"timeouts.push_retry_backoff_initial_ms: must not exceed "
            f"timeouts.push_retry_backoff_max_ms ({timeouts.push_retry_backoff_max_ms}), "
            f"got {timeouts.push_retry_backoff_initial_ms}"
        )


def _validate_retry(retry: RetryConfig) -> None:
    """Each bound within the shared policy's limits; backoff starts no higher than its cap."""
    for name, (low, high) in RETRY_POLICY_BOUNDS.items():
        _check_int(getattr(retry, f"retry_{name}"), f"retry.retry_{name}", low, high)
    if retry.retry_backoff_initial_ms > retry.retry_backoff_max_ms:
        raise ConfigError(
            f"retry.retry_backoff_initial_ms: must not exceed retry.retry_backoff_max_ms "
            f"({retry.retry_backoff_max_ms}), got {retry.retry_backoff_initial_ms}"
        )


_LIMIT_BOUNDS: Mapping[str, tuple[int, int]] = {
    "max_event_bytes": (1, GRPC_MESSAGE_BYTES_MAX),
    "max_batch_events": (1, 1_000_000),
    "max_batch_bytes": (1, GRPC_MESSAGE_BYTES_MAX),
    "max_message_bytes": (1, GRPC_MESSAGE_BYTES_MAX),
    "map_size_bytes": (1 * MiB, 2**44),
    "dedupe_window": (1, 100_000_000),
    "max_topics": (1, 1_000_000),
    "commit_batch_max_entries": (1, 100_000),
    "subscribe_batch_max_events": (1, 1_000_000),
    "subscribe_batch_default_bytes": (1, GRPC_MESSAGE_BYTES_MAX),
    "log_retention_entries": (1, 2**40),
    # The upper bounds are the replication core's (services/replica/replication.py).
    "replication_inflight_entries_max": (1, 1 << 20),
    "replication_inflight_bytes_max": (1, 1 << 36),
    "replication_pending_writes_max": (1, 1 << 24),
    "push_batch_max_events": (1, 1_000_000),
    "push_batch_max_bytes": (1, GRPC_MESSAGE_BYTES_MAX),
    "push_inflight_batches_max": (1, 64),
    "push_subscribers_max": (1, 100_000),
    "client_streams_max": (1, 100_000),
    "client_inflight_publishes_max": (1, 1_000_000),
    # gRPC's own default is 8 KiB; below 1 KiB the trace and auth headers may not fit.
    "metadata_bytes_max": (1024, 1 * MiB),
    "topic_subscriptions_max": (1, 1_000_000),
    "max_topic_name_bytes": (1, TOPIC_NAME_MAX_BYTES),
    "max_subscription_name_bytes": (1, SUBSCRIPTION_NAME_MAX_BYTES),
    "max_publisher_id_bytes": (1, PUBLISHER_ID_MAX_BYTES),
}


def _validate_limits(limits: LimitsConfig) -> None:
    """Each limit within its bounds, and the limits consistent with one another."""
    for key, (low, high) in _LIMIT_BOUNDS.items():
        _check_int(getattr(limits, key), f"limits.{key}", low, high)
    # (smaller, larger, why): smaller must not exceed larger.
    orderings = (
        ("max_event_bytes", "max_batch_bytes", "a batch must be able to hold one event"),
        ("max_batch_bytes", "max_message_bytes", "a full batch must fit in one gRPC message"),
        ("max_batch_bytes", "map_size_bytes", "the store must be able to hold a full batch"),
        (
            "max_batch_events",
            "dedupe_window",
            "a retried full batch must be deduplicated as a whole",
        ),
        (
            "subscribe_batch_max_events",
            "max_batch_events",
            "a subscribe batch is a batch",
        ),
        (
            "commit_batch_max_entries",
            "log_retention_entries",
            "the retained log must hold at least one commit batch",
        ),
        (
            "commit_batch_max_entries",
            "replication_inflight_entries_max",
            "one replication message carries a commit batch",
        ),
        (
            "replication_inflight_bytes_max",
            "max_message_bytes",
            "a full replication window must fit in one gRPC message",
        ),
        ("push_batch_max_events", "max_batch_events", "a push batch is a batch"),
        (
            "push_batch_max_bytes",
            "max_message_bytes",
            "a push batch must fit in one gRPC message",
        ),
    )
    for smaller, larger, why in orderings:
        small_value = getattr(limits, smaller)
        large_value = getattr(limits, larger)
        if small_value > large_value:
            raise ConfigError(
                f"limits.{smaller}: must not exceed limits.{larger} ({large_value}) because "
                f"{why}, got {small_value}"
            )


def _validate_durability(durability: DurabilityConfig) -> None:
    """Each policy is one of the allowed enum values (never UNSPECIFIED)."""
    sync_values = set(SYNC_POLICY_NAMES.values())
    for key in ("master_sync", "replica_sync"):
        value = getattr(durability, key)
        if _is_int(value) and value in sync_values:
            continue
        raise ConfigError(
            f"durability.{key}: must be one of {', '.join(SYNC_POLICY_NAMES)}, got {_show(value)}"
        )
    if not (_is_int(durability.acks) and durability.acks in set(ACK_POLICY_NAMES.values())):
        raise ConfigError(
            f"durability.acks: must be one of {', '.join(ACK_POLICY_NAMES)}, "
            f"got {_show(durability.acks)}"
        )


def _validate_telemetry(telemetry: TelemetryConfig, listeners: dict[tuple[str, int], str]) -> None:
    """The exporter is known, its settings are in range, and no scrape port clashes."""
    _check_choice(telemetry.exporter, "telemetry.exporter", TELEMETRY_EXPORTERS)
    _check_str(telemetry.otlp_endpoint, "telemetry.otlp_endpoint")
    if any(char.isspace() for char in telemetry.otlp_endpoint):
        raise ConfigError(
            f"telemetry.otlp_endpoint: must not contain whitespace, "
            f"got {_show(telemetry.otlp_endpoint)}"
        )
    host = telemetry.prometheus_host
    _check_str(host, "telemetry.prometheus_host")
    wildcard = host in _WILDCARD_HOSTS
    if not wildcard:
        try:
            parse_address(f"{host}:1")
        except ValueError as error:
            raise ConfigError(f"telemetry.prometheus_host: {error}, got {_show(host)}") from None
    ports: dict[int, str] = {}
    for service in ("coordinator", "replica", "gateway"):
        field_name = f"telemetry.{service}_prometheus_port"
        port = telemetry.prometheus_port(service)
        _check_int(port, field_name, 0, 65535)
        if port == 0:
            continue  # picked at start-up, logged
        if port in ports:
            # A node's coordinator and replica share a host, so their ports must differ.
            raise ConfigError(f"{field_name}: {port} is already {ports[port]}")
        ports[port] = field_name
        for (listener_host, listener_port), owner in listeners.items():
            if listener_port == port and (wildcard or listener_host == host.lower()):
                raise ConfigError(f"{field_name}: port {port} on {host} is already used by {owner}")
    ratio = telemetry.trace_sample_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError(
            "telemetry.trace_sample_ratio: must be a number from 0 to 1 (the share of new "
            f"traces recorded), got {_describe(ratio)}"
        )
    _check_int(telemetry.metrics_interval_ms, "telemetry.metrics_interval_ms", 100, 3_600_000)


def _validate_logging(logging_config: LogConfig) -> None:
    """Level and format are known."""
    _check_choice(logging_config.level, "logging.level", LOG_LEVELS)
    _check_choice(logging_config.format, "logging.format", LOG_FORMATS)


# --------------------------------------------------------------------------- addresses

_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_HOSTNAME_MAX_CHARS = 253


def parse_address(address: str) -> tuple[str, int]:
    """Split 'host:port' ('[v6]:port' for IPv6) into (host, port); ValueError if malformed.

    The host is a DNS name, an IPv4 address or a bracketed IPv6 address, and not a wildcard
    (peers dial this address); the port is 1..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError("must be host:port")
    if not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError("an IPv6 host must be in brackets, as in [::1]:7101")
    elif re.fullmatch(r"[0-9.]+", host):
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
    else:
        labels = host.split(".")
        if len(host) > _HOSTNAME_MAX_CHARS or not all(
            _HOST_LABEL_RE.fullmatch(label) for label in labels
        ):
            raise ValueError(f"{host!r} is not a valid host name")
        return host, port
    if ip.is_unspecified:
        raise ValueError(
            f"{host} is a wildcard address; peers dial this address, so give the host's name or IP"
        )
    return host, port


def _claim_address(address: object, field_name: str, listeners: dict[tuple[str, int], str]) -> None:
    """Check an address and record it, rejecting one already used by another listener."""
    if not isinstance(address, str):
        raise ConfigError(f"{field_name}: must be a string, got {_describe(address)}")
    try:
        host, port = parse_address(address)
    except ValueError as error:
        raise ConfigError(f"{field_name}: {error}, got {_show(address)}") from None
    key = (host.lower(), port)
    if key in listeners:
        raise ConfigError(f"{field_name}: {_show(address)} is already used by {listeners[key]}")
    listeners[key] = field_name


# --------------------------------------------------------------------------- value checks


def _is_int(value: object) -> bool:
    """True for an int that is not a bool (TOML true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: object, field_name: str, low: int, high: int) -> None:
    """An integer (not a boolean) in low..high."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field_name}: must be an integer, got {_describe(value)}")
    if not low <= value <= high:
        raise ConfigError(f"{field_name}: must be from {low} to {high}, got {value}")


def _check_str(value: object, field_name: str) -> None:
    """A string."""
    if not isinstance(value, str):
        raise ConfigError(f"{field_name}: must be a string, got {_describe(value)}")


def _check_choice(value: object, field_name: str, choices: Sequence[str]) -> None:
    """One of a fixed set of strings."""
    _check_str(value, field_name)
    if value not in choices:
        raise ConfigError(f"{field_name}: must be one of {', '.join(choices)}, got {_show(value)}")


def _check_id(value: object, field_name: str, what: str) -> None:
    """An id of the node id grammar (names.validate_node_id)."""
    _check_str(value, field_name)
    try:
        validate_node_id(str(value), what)
    except ValueError as error:
        raise ConfigError(f"{field_name}: {error}") from None


def _label(kind: str, entry_id: object) -> str:
    """' (node 'n2')' for messages about an entry whose id is a string."""
    return f" ({kind} {_show(entry_id)})" if isinstance(entry_id, str) else ""


def _show(value: object) -> str:
    """A value as it would be written in TOML, shortened when long."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = repr(value)
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(_show(v) for v in value) + "]"
    else:
        text = str(value)
    if len(text) > _SHOWN_CHARS_MAX:
        text = text[:_SHOWN_CHARS_MAX] + "..."
    return text


def _describe(value: object) -> str:
    """A value and its TOML type, as in "true (a boolean)"."""
    if isinstance(value, bool):
        kind = "a boolean"
    elif isinstance(value, int):
        kind = "an integer"
    elif isinstance(value, float):
        kind = "a float"
    elif isinstance(value, str):
        kind = "a string"
    elif isinstance(value, list):
        kind = "an array"
    elif isinstance(value, dict):
        kind = "a table"
    else:
        kind = "a date/time" if hasattr(value, "isoformat") else type(value).__name__
    return f"{_show(value)} ({kind})"
