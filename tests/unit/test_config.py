"""The configuration file: the shipped files load, and every bad file gets one clear sentence.

Each error test asserts what an operator reads: the field path and the bad value.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import squall
from squall.v1 import common_pb2
from squall_server.common.config import (
    ClusterConfig,
    ConfigError,
    GatewayConfig,
    LimitsConfig,
    NodeConfig,
    RetryConfig,
    TimeoutsConfig,
    load_config,
    load_config_or_exit,
    parse_address,
    parse_config,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# A valid three-node file; each error test changes one thing in it.
VALID = """\
[cluster]
name = "test"

[[nodes]]
id = "n1"
priority = 3
coordinator_address = "127.0.0.1:7101"
replica_address = "127.0.0.1:7201"
data_dir = "data/n1"

[[nodes]]
id = "n2"
priority = 2
coordinator_address = "127.0.0.1:7102"
replica_address = "127.0.0.1:7202"
data_dir = "data/n2"

[[nodes]]
id = "n3"
priority = 1
coordinator_address = "127.0.0.1:7103"
replica_address = "127.0.0.1:7203"
data_dir = "data/n3"

[[gateways]]
id = "g1"
address = "127.0.0.1:7100"
"""


def parse(text: str, base: Path = Path("/etc/squall")) -> ClusterConfig:
    """Parse text as if read from <base>/squall.toml."""
    return parse_config(text, base / "squall.toml")


def error_of(text: str) -> str:
    """The ConfigError message for text; fails the test if it parses."""
    with pytest.raises(ConfigError) as caught:
        parse(text)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def replaced(old: str, new: str, text: str = VALID) -> str:
    """text with the first occurrence of old replaced by new (old must be there)."""
    assert old in text, old
    return text.replace(old, new, 1)


# --------------------------------------------------------------------------- files that load


@pytest.mark.parametrize("name", ["cluster.example.toml", "single.toml"])
def test_deploy_files_load(name: str) -> None:
    config = load_config(DEPLOY / name)
    assert config.nodes and config.gateways
    assert config.path == (DEPLOY / name).absolute()
    for node in config.nodes:
        assert node.data_dir.is_absolute()
        # Relative data_dirs resolve against the file's directory, not the working directory.
        assert node.data_dir.is_relative_to(REPO / "data")


def test_example_cluster_shape() -> None:
    config = load_config(DEPLOY / "cluster.example.toml")
    assert [(n.id, n.priority) for n in config.nodes] == [("n1", 3), ("n2", 2), ("n3", 1)]
    assert config.majority == 2
    assert config.gateway().id == "g1"


def test_single_node_is_its_own_majority() -> None:
    config = load_config(DEPLOY / "single.toml")
    assert len(config.nodes) == 1
    assert config.majority == 1


def test_defaults_apply_when_sections_are_absent() -> None:
    config = parse(VALID)
    assert config.timeouts == TimeoutsConfig()
    assert config.limits == LimitsConfig()
    assert config.timeouts.member_timeout_ms == 400
    assert config.limits.max_event_bytes == 1024 * 1024
    assert config.limits.max_topic_name_bytes == 255
    assert config.durability.master_sync == common_pb2.SYNC_POLICY_SYNC
    assert config.durability.replica_sync == common_pb2.SYNC_POLICY_WRITE_NO_SYNC
    assert config.durability.acks == common_pb2.ACK_POLICY_MAJORITY
    assert config.telemetry.exporter == "none"
    assert (config.logging.level, config.logging.format) == ("INFO", "text")


def test_relative_data_dir_resolves_against_config_directory(tmp_path: Path) -> None:
    config = parse(VALID, base=tmp_path / "conf")
    assert config.node("n2").data_dir == tmp_path / "conf" / "data" / "n2"


def test_absolute_data_dir_is_kept(tmp_path: Path) -> None:
    config = parse(replaced('data_dir = "data/n1"', f'data_dir = "{tmp_path / "store"}"'))
    assert config.node("n1").data_dir == tmp_path / "store"


def test_enum_strings_are_case_insensitive() -> None:
    config = parse(
        VALID
        + '[durability]\nmaster_sync = "write_no_sync"\nreplica_sync = "No_Sync"\nacks = "ALL"\n'
        + '[logging]\nlevel = "debug"\nformat = "JSON"\n'
        + '[telemetry]\nexporter = "Console"\n'
    )
    assert config.durability.master_sync == common_pb2.SYNC_POLICY_WRITE_NO_SYNC
    assert config.durability.replica_sync == common_pb2.SYNC_POLICY_NO_SYNC
    assert config.durability.acks == common_pb2.ACK_POLICY_ALL
    assert (config.logging.level, config.logging.format) == ("DEBUG", "json")
    assert config.telemetry.exporter == "console"


def test_ipv6_and_host_names_are_accepted() -> None:
    config = parse(
        replaced(
            '"127.0.0.1:7101"', '"[::1]:7101"', replaced('"127.0.0.1:7100"', '"gw.example:80"')
        )
    )
    assert config.node("n1").coordinator_address == "[::1]:7101"
    assert parse_address("[::1]:7101") == ("[::1]", 7101)
    assert parse_address("gw.example:80") == ("gw.example", 80)


def test_node_lookup() -> None:
    config = parse(VALID)
    assert config.node("n2").priority == 2
    with pytest.raises(ConfigError, match=r"unknown node id 'x'; configured: n1, n2, n3"):
        config.node("x")


def test_gateway_lookup() -> None:
    config = parse(VALID)
    assert config.gateway("g1").address == "127.0.0.1:7100"
    assert config.gateway(None).id == "g1"
    with pytest.raises(ConfigError, match=r"unknown gateway id 'g9'; configured: g1"):
        config.gateway("g9")


@pytest.mark.parametrize(("count", "majority"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_majority(count: int, majority: int) -> None:
    nodes = tuple(
        NodeConfig(f"n{i}", 1, f"h:{1000 + i}", f"h:{2000 + i}", Path(f"/d/n{i}"))
        for i in range(count)
    )
    config = ClusterConfig("c", nodes, (GatewayConfig("g", "h:3000"),))
    config.validate()
    assert config.majority == majority


def test_configs_built_in_code_are_validated_too() -> None:
    config = parse(VALID)
    bad = dataclasses.replace(
        config, timeouts=dataclasses.replace(config.timeouts, heartbeat_interval_ms=0)
    )
    with pytest.raises(ConfigError, match=r"timeouts\.heartbeat_interval_ms: .* got 0"):
        bad.validate()


# --------------------------------------------------------------------------- one test per error


def test_unreadable_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file: No such file or directory"):
        load_config(tmp_path / "absent.toml")


def test_unreadable_file_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file: Is a directory"):
        load_config(tmp_path)


def test_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[cluster]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match=r"not valid UTF-8 \(line 2\)"):
        load_config(path)


def test_invalid_toml_reports_line_and_column() -> None:
    message = error_of(VALID + "[timeouts\n")
    assert message.startswith("invalid TOML: ")
    bad_line = VALID.count("\n") + 1
    assert f"(at line {bad_line}, column 10)" in message


def test_duplicate_key_is_invalid_toml() -> None:
    message = error_of(replaced('name = "test"', 'name = "test"\nname = "again"'))
    assert message.startswith("invalid TOML: ")
    assert "line 3" in message


def test_unknown_section() -> None:
    message = error_of(VALID + "[timeout]\nheartbeat_interval_ms = 100\n")
    assert message == "unknown section [timeout]; did you mean [timeouts]?"


def test_unknown_top_level_key() -> None:
    message = error_of('name = "x"\n' + VALID)
    assert "unknown top-level key 'name'" in message


def test_unknown_key_in_section() -> None:
    message = error_of(VALID + "[timeouts]\nheartbeat_intervall_ms = 100\n")
    assert message.startswith("unknown key 'heartbeat_intervall_ms' in [timeouts]")
    assert "did you mean 'heartbeat_interval_ms'?" in message


def test_unknown_key_in_node_entry() -> None:
    message = error_of(replaced("priority = 2", "prority = 2"))
    assert message.startswith("unknown key 'prority' in nodes[1] (node 'n2')")
    assert "did you mean 'priority'?" in message


def test_name_limits_may_only_be_stricter_than_the_name_grammar() -> None:
    config = parse_config(VALID + "[limits]\nmax_topic_name_bytes = 100\n", "/tmp/c.toml")
    assert config.limits.max_topic_name_bytes == 100
    message = error_of(VALID + "[limits]\nmax_topic_name_bytes = 256\n")
    assert message.startswith("limits.max_topic_name_bytes: ")
    assert "256" in message and "255" in message
    message = error_of(VALID + "[limits]\nmax_publisher_id_bytes = 0\n")
    assert message.startswith("limits.max_publisher_id_bytes: ")


def test_wrong_type_bool_for_int() -> None:
    message = error_of(VALID + "[timeouts]\nheartbeat_interval_ms = true\n")
    assert message == "timeouts.heartbeat_interval_ms: must be an integer, got true (a boolean)"


def test_wrong_type_bool_for_priority() -> None:
    message = error_of(replaced("priority = 3", "priority = false"))
    assert message == "nodes[0].priority (node 'n1'): must be an integer, got false (a boolean)"


def test_wrong_type_string_for_int() -> None:
    message = error_of(VALID + '[limits]\nmax_event_bytes = "1MiB"\n')
    assert message == "limits.max_event_bytes: must be an integer, got '1MiB' (a string)"


def test_wrong_type_float_for_int() -> None:
    message = error_of(VALID + "[timeouts]\nrpc_timeout_ms = 2.5\n")
    assert message == "timeouts.rpc_timeout_ms: must be an integer, got 2.5 (a float)"


def test_wrong_type_int_for_string() -> None:
    message = error_of(replaced('address = "127.0.0.1:7100"', "address = 7100"))
    assert message == "gateways[0].address (gateway 'g1'): must be a string, got 7100 (an integer)"


def test_wrong_shape_table_for_array() -> None:
    message = error_of(replaced("[[gateways]]", "[gateways]"))
    assert message.startswith("gateways: must be an array of tables written [[gateways]]")


def test_missing_field() -> None:
    message = error_of(replaced('replica_address = "127.0.0.1:7202"\n', ""))
    assert message == "nodes[1].replica_address (node 'n2'): required key is missing"


def test_missing_cluster_name() -> None:
    message = error_of(replaced('name = "test"\n', ""))
    assert message == "cluster.name: required key is missing"


def test_missing_cluster_section() -> None:
    message = error_of(replaced('[cluster]\nname = "test"\n', ""))
    assert message.startswith("missing section [cluster]")


def test_bad_cluster_name() -> None:
    message = error_of(replaced('name = "test"', 'name = "my cluster"'))
    assert message.startswith("cluster.name: invalid cluster name 'my cluster'")


def test_bad_node_id() -> None:
    message = error_of(replaced('id = "n2"', 'id = "n/2"'))
    assert message.startswith("nodes[1].id: invalid node id 'n/2': character '/'")


def test_duplicate_node_id() -> None:
    message = error_of(replaced('id = "n3"', 'id = "n1"'))
    assert message == "nodes[2].id: 'n1' is already the id of nodes[0]"


def test_duplicate_gateway_id() -> None:
    message = error_of(VALID + '[[gateways]]\nid = "g1"\naddress = "127.0.0.1:7099"\n')
    assert message == "gateways[1].id: 'g1' is already the id of gateways[0]"


def test_duplicate_address_between_nodes() -> None:
    message = error_of(
        replaced('replica_address = "127.0.0.1:7202"', 'replica_address = "127.0.0.1:7101"')
    )
    assert message == (
        "nodes[1].replica_address (node 'n2'): '127.0.0.1:7101' is already used by "
        "nodes[0].coordinator_address (node 'n1')"
    )


def test_duplicate_address_between_node_and_gateway() -> None:
    message = error_of(replaced('address = "127.0.0.1:7100"', 'address = "127.0.0.1:7203"'))
    assert message == (
        "gateways[0].address (gateway 'g1'): '127.0.0.1:7203' is already used by "
        "nodes[2].replica_address (node 'n3')"
    )


def test_duplicate_address_ignores_host_case() -> None:
    text = replaced('"127.0.0.1:7101"', '"LocalHost:7101"')
    message = error_of(replaced('"127.0.0.1:7102"', '"localhost:7101"', text))
    assert "'localhost:7101' is already used by nodes[0].coordinator_address" in message


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "must be host:port"),
        (":7101", "must be host:port"),
        ("127.0.0.1:", "port '' is not a number"),
        ("127.0.0.1:http", "port 'http' is not a number"),
        ("300.1.1.1:7101", "'300.1.1.1' is not an IPv4 address"),
        ("::1:7101", "an IPv6 host must be in brackets"),
        ("[::g]:7101", "'[::g]' is not an IPv6 address"),
        ("bad_host:7101", "'bad_host' is not a valid host name"),
        ("0.0.0.0:7101", "0.0.0.0 is a wildcard address"),
        ("[::]:7101", "[::] is a wildcard address"),
    ],
)
def test_bad_address(address: str, reason: str) -> None:
    message = error_of(replaced('"127.0.0.1:7102"', f'"{address}"'))
    assert message.startswith(f"nodes[1].coordinator_address (node 'n2'): {reason}")
    assert message.endswith(f"got '{address}'")


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_bad_port(port: str) -> None:
    message = error_of(replaced('"127.0.0.1:7100"', f'"127.0.0.1:{port}"'))
    assert message == (
        f"gateways[0].address (gateway 'g1'): port {int(port)} is outside 1..65535, "
        f"got '127.0.0.1:{port}'"
    )


@pytest.mark.parametrize("priority", ["-1", "1001"])
def test_bad_priority(priority: str) -> None:
    message = error_of(replaced("priority = 2", f"priority = {priority}"))
    assert message == f"nodes[1].priority (node 'n2'): must be from 0 to 1000, got {priority}"


def test_no_eligible_coordinator() -> None:
    text = VALID
    for priority in (3, 2, 1):
        text = replaced(f"priority = {priority}", "priority = 0", text)
    message = error_of(text)
    assert message.startswith("nodes[*].priority: every node has priority 0")


def test_priority_zero_nodes_are_fine_with_one_eligible() -> None:
    config = parse(replaced("priority = 2", "priority = 0"))
    assert config.node("n2").priority == 0


def test_bad_enum_acks() -> None:
    message = error_of(VALID + '[durability]\nacks = "most"\n')
    assert message == "durability.acks: must be one of majority, all, none, group, got 'most'"


def test_deprecated_durability_names_load_as_what_they_do_and_say_so() -> None:
    """acks "all" waits for the current group only: "group" names it; master NO_SYNC
    behaves as WRITE_NO_SYNC (a master writes before it replicates) and is loaded as it."""
    group = parse(VALID + '[durability]\nacks = "group"\n')
    assert group.durability.acks == common_pb2.ACK_POLICY_ALL and group.deprecations == ()
    old = parse(VALID + '[durability]\nacks = "all"\nmaster_sync = "no_sync"\n')
    assert old.durability.acks == common_pb2.ACK_POLICY_ALL
    assert old.durability.master_sync == common_pb2.SYNC_POLICY_WRITE_NO_SYNC
    assert len(old.deprecations) == 2
    assert 'write acks = "group"' in old.deprecations[0]
    assert "every member of the current group, not every configured node" in old.deprecations[0]
    assert "behaves as WRITE_NO_SYNC" in old.deprecations[1]
    # A replica's NO_SYNC is real (it acknowledges on receipt): kept, not deprecated.
    replica = parse(VALID + '[durability]\nreplica_sync = "NO_SYNC"\n')
    assert replica.durability.replica_sync == common_pb2.SYNC_POLICY_NO_SYNC
    assert replica.deprecations == ()
    # Old and new names agree between members (a rolling upgrade is not refused).
    assert dict(old.agreed_settings())["durability.acks"] == "all"
    assert (
        old.agreed_settings()
        == parse(
            VALID + '[durability]\nacks = "group"\nmaster_sync = "WRITE_NO_SYNC"\n'
        ).agreed_settings()
    )


def test_bad_enum_sync() -> None:
    message = error_of(VALID + '[durability]\nmaster_sync = "fsync"\n')
    assert message == (
        "durability.master_sync: must be one of SYNC, WRITE_NO_SYNC, NO_SYNC, got 'fsync'"
    )


def test_bad_enum_exporter() -> None:
    message = error_of(VALID + '[telemetry]\nexporter = "jaeger"\n')
    assert message == (
        "telemetry.exporter: must be one of none, console, otlp, prometheus, got 'jaeger'"
    )


def test_bad_enum_log_level() -> None:
    message = error_of(VALID + '[logging]\nlevel = "verbose"\n')
    assert message == (
        "logging.level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'verbose'"
    )


def test_prometheus_ports_default_to_free_ports() -> None:
    config = parse(VALID + '[telemetry]\nexporter = "prometheus"\n')
    telemetry = config.telemetry
    assert telemetry.prometheus_host == "127.0.0.1"
    assert [telemetry.prometheus_port(s) for s in ("coordinator", "replica", "gateway")] == [0] * 3


def test_prometheus_port_must_not_clash_with_a_service() -> None:
    text = VALID + '[telemetry]\nexporter = "prometheus"\nreplica_prometheus_port = 7100\n'
    message = error_of(text)
    assert message == (
        "telemetry.replica_prometheus_port: port 7100 on 127.0.0.1 is already used by "
        "gateways[0].address (gateway 'g1')"
    )


def test_prometheus_ports_of_one_host_must_differ() -> None:
    text = (
        VALID + "[telemetry]\ncoordinator_prometheus_port = 9464\nreplica_prometheus_port = 9464\n"
    )
    assert error_of(text) == (
        "telemetry.replica_prometheus_port: 9464 is already telemetry.coordinator_prometheus_port"
    )


def test_prometheus_port_out_of_range() -> None:
    message = error_of(VALID + "[telemetry]\ngateway_prometheus_port = 70000\n")
    assert message == "telemetry.gateway_prometheus_port: must be from 0 to 65535, got 70000"


def test_prometheus_host_may_be_a_wildcard_but_not_garbage() -> None:
    config = parse(VALID + '[telemetry]\nprometheus_host = "0.0.0.0"\n')
    assert config.telemetry.prometheus_host == "0.0.0.0"
    message = error_of(VALID + '[telemetry]\nprometheus_host = "not a host"\n')
    assert message == (
        "telemetry.prometheus_host: 'not a host' is not a valid host name, got 'not a host'"
    )


def test_old_prometheus_address_key_names_its_replacement() -> None:
    message = error_of(VALID + '[telemetry]\nprometheus_address = "127.0.0.1:9464"\n')
    assert message.startswith("telemetry.prometheus_address: was replaced by prometheus_host")


def test_trace_sample_ratio_bounds() -> None:
    assert parse(
        VALID + "[telemetry]\ntrace_sample_ratio = 0.25\n"
    ).telemetry.trace_sample_ratio == (0.25)
    assert parse(VALID + "[telemetry]\ntrace_sample_ratio = 1\n").telemetry.trace_sample_ratio == 1
    message = error_of(VALID + "[telemetry]\ntrace_sample_ratio = 1.5\n")
    assert message == (
        "telemetry.trace_sample_ratio: must be a number from 0 to 1 (the share of new traces "
        "recorded), got 1.5 (a float)"
    )


def test_metrics_interval_bounds() -> None:
    message = error_of(VALID + "[telemetry]\nmetrics_interval_ms = 10\n")
    assert message == "telemetry.metrics_interval_ms: must be from 100 to 3600000, got 10"


def test_inconsistent_limits_event_over_batch() -> None:
    message = error_of(VALID + "[limits]\nmax_event_bytes = 2048\nmax_batch_bytes = 1024\n")
    assert message.startswith(
        "limits.max_event_bytes: must not exceed limits.max_batch_bytes (1024)"
    )
    assert message.endswith("got 2048")


def test_inconsistent_limits_batch_over_message() -> None:
    message = error_of(VALID + "[limits]\nmax_batch_bytes = 40000000\n")
    assert message.startswith(
        "limits.max_batch_bytes: must not exceed limits.max_message_bytes (33554432)"
    )
    assert message.endswith("got 40000000")


def test_inconsistent_limits_dedupe_window_under_batch() -> None:
    message = error_of(VALID + "[limits]\ndedupe_window = 10\n")
    assert message.startswith("limits.max_batch_events: must not exceed limits.dedupe_window (10)")


def test_map_size_at_least_one_mib() -> None:
    message = error_of(VALID + "[limits]\nmap_size_bytes = 4096\n")
    assert message == "limits.map_size_bytes: must be from 1048576 to 17592186044416, got 4096"


def test_limit_must_be_positive() -> None:
    message = error_of(VALID + "[limits]\nmax_topics = 0\n")
    assert message == "limits.max_topics: must be from 1 to 1000000, got 0"


def test_timeout_must_be_positive() -> None:
    message = error_of(VALID + "[timeouts]\npublish_timeout_ms = -5\n")
    assert message == "timeouts.publish_timeout_ms: must be from 10 to 3600000, got -5"


def test_member_timeout_must_outlast_heartbeats() -> None:
    message = error_of(VALID + "[timeouts]\nheartbeat_interval_ms = 300\n")
    assert message.startswith(
        "timeouts.member_timeout_ms: must be at least twice timeouts.heartbeat_interval_ms (300)"
    )
    assert message.endswith("got 400")


def test_replica_timeout_must_outlast_two_heartbeats() -> None:
    assert parse(VALID).timeouts.replica_timeout_ms == 300
    message = error_of(VALID + "[timeouts]\nreplica_timeout_ms = 150\n")
    assert message == (
        "timeouts.replica_timeout_ms: must be at least twice timeouts.heartbeat_interval_ms "
        "(100), so one slow role renewal does not take the node out of its group, got 150"
    )
    assert error_of(VALID + "[timeouts]\nreplica_timeout_ms = 0\n") == (
        "timeouts.replica_timeout_ms: must be from 10 to 600000, got 0"
    )


def test_store_stall_timeout_defaults_above_a_slow_disk_and_is_bounded() -> None:
    assert parse(VALID).timeouts.store_stall_timeout_ms == 2000
    custom = parse(VALID + "[timeouts]\nstore_stall_timeout_ms = 5000\n")
    assert custom.timeouts.store_stall_timeout_ms == 5000
    assert error_of(VALID + "[timeouts]\nstore_stall_timeout_ms = 50\n") == (
        "timeouts.store_stall_timeout_ms: must be from 100 to 600000, got 50"
    )
    message = error_of(
        VALID + "[timeouts]\nheartbeat_interval_ms = 100\nstore_stall_timeout_ms = 150\n"
    )
    assert message.startswith(
        "timeouts.store_stall_timeout_ms: must be at least twice "
        "timeouts.heartbeat_interval_ms (100)"
    ), message


def test_push_backoff_must_start_below_its_cap() -> None:
    message = error_of(VALID + "[timeouts]\npush_retry_backoff_initial_ms = 9000\n")
    assert message == (
        "timeouts.push_retry_backoff_initial_ms: must not exceed "
        "timeouts.push_retry_backoff_max_ms (5000), got 9000"
    )


def test_push_limits() -> None:
    message = error_of(VALID + "[limits]\npush_batch_max_events = 20000\n")
    assert message.startswith(
        "limits.push_batch_max_events: must not exceed limits.max_batch_events (10000)"
    )
    message = error_of(VALID + "[limits]\npush_inflight_batches_max = 0\n")
    assert message == "limits.push_inflight_batches_max: must be from 1 to 64, got 0"
    message = error_of(VALID + "[limits]\npush_batch_max_bytes = 40000000\n")
    assert message.startswith(
        "limits.push_batch_max_bytes: must not exceed limits.max_message_bytes (33554432)"
    )


def test_no_gateway() -> None:
    message = error_of(VALID.split("[[gateways]]")[0])
    assert message == "gateways: at least one [[gateways]] entry is required; none is configured"


def test_no_node() -> None:
    text = '[cluster]\nname = "c"\n[[gateways]]\nid = "g1"\naddress = "127.0.0.1:7100"\n'
    message = error_of(text)
    assert message == "nodes: at least one [[nodes]] entry is required; none is configured"


def test_duplicate_data_dir() -> None:
    message = error_of(replaced('data_dir = "data/n2"', 'data_dir = "./data/../data/n1"'))
    assert message == (
        "nodes[1].data_dir (node 'n2'): '/etc/squall/data/n1' is already the data_dir of "
        "nodes[0] (node 'n1')"
    )


def test_nested_data_dir() -> None:
    message = error_of(replaced('data_dir = "data/n2"', 'data_dir = "data/n1/inner"'))
    assert message.startswith(
        "nodes[1].data_dir (node 'n2'): '/etc/squall/data/n1/inner' is inside the data_dir of "
        "nodes[0] (node 'n1')"
    )


def test_empty_data_dir() -> None:
    message = error_of(replaced('data_dir = "data/n2"', 'data_dir = ""'))
    assert message == "nodes[1].data_dir (node 'n2'): must be a directory path, got ''"


def test_error_carries_the_path(tmp_path: Path) -> None:
    path = tmp_path / "squall.toml"
    path.write_text(VALID + "[timeouts]\nrpc_timeout_ms = 0\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.path == path


# --------------------------------------------------------------------------- exiting


def run_load_or_exit(path: Path) -> subprocess.CompletedProcess[str]:
    """Run load_config_or_exit(path) in a fresh interpreter, as a service's main would."""
    code = (
        "from squall_server.common.config import load_config_or_exit; "
        f"load_config_or_exit({str(path)!r})"
    )
    venv_python = REPO / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    return subprocess.run(
        [python, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_load_config_or_exit_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(VALID + "[timeouts]\nheartbeat_intervall_ms = 100\n")
    result = run_load_or_exit(path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines == [
        f"squall: config error: {path}: unknown key 'heartbeat_intervall_ms' in [timeouts]; "
        "did you mean 'heartbeat_interval_ms'?"
    ]


def test_load_config_or_exit_on_missing_file(tmp_path: Path) -> None:
    result = run_load_or_exit(tmp_path / "absent.toml")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"squall: config error: {tmp_path / 'absent.toml'}: cannot read the file: "
        "No such file or directory"
    ]


def test_load_config_or_exit_reports_unknown_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "squall.toml"
    path.write_text(VALID)
    with pytest.raises(SystemExit) as caught:
        load_config_or_exit(path, node_id="n9")
    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        f"squall: config error: {path}: unknown node id 'n9'; configured: n1, n2, n3\n"
    )


def test_load_config_or_exit_returns_the_config(tmp_path: Path) -> None:
    path = tmp_path / "squall.toml"
    path.write_text(VALID)
    config = load_config_or_exit(path, node_id="n1", gateway_id="g1")
    assert config.node("n1").priority == 3


def test_replication_limits_default() -> None:
    limits = LimitsConfig()
    assert limits.replication_inflight_entries_max == 1024
    assert limits.replication_inflight_bytes_max == 8 * 1024 * 1024
    assert limits.replication_pending_writes_max == 65536


def test_replication_limits_are_read() -> None:
    config = parse(
        VALID
        + "[limits]\nreplication_inflight_entries_max = 512\n"
        + "replication_inflight_bytes_max = 1048576\nreplication_pending_writes_max = 100\n"
    )
    assert config.limits.replication_inflight_entries_max == 512
    assert config.limits.replication_inflight_bytes_max == 1048576
    assert config.limits.replication_pending_writes_max == 100


def test_replication_pending_writes_must_be_positive() -> None:
    message = error_of(VALID + "[limits]\nreplication_pending_writes_max = 0\n")
    assert message == "limits.replication_pending_writes_max: must be from 1 to 16777216, got 0"


def test_replication_window_at_least_a_commit_batch() -> None:
    message = error_of(VALID + "[limits]\nreplication_inflight_entries_max = 100\n")
    assert message.startswith(
        "limits.commit_batch_max_entries: must not exceed "
        "limits.replication_inflight_entries_max (100)"
    )


def test_replication_window_fits_a_message() -> None:
    message = error_of(VALID + "[limits]\nreplication_inflight_bytes_max = 40000000\n")
    assert message.startswith(
        "limits.replication_inflight_bytes_max: must not exceed limits.max_message_bytes"
    )
    assert message.endswith("got 40000000")


# --------------------------------------------------------------------------- [retry]


def test_retry_defaults_are_the_client_librarys() -> None:
    config = parse(VALID)
    assert config.retry == RetryConfig()
    assert config.retry.policy() == squall.RetryPolicy()
    assert (
        config.retry.retry_attempts_max,
        config.retry.retry_backoff_initial_ms,
        config.retry.retry_backoff_max_ms,
        config.retry.retry_total_ms_max,
    ) == (0, 50, 250, 10000)


def test_retry_section_is_read() -> None:
    config = parse(
        VALID
        + "[retry]\nretry_attempts_max = 3\nretry_backoff_initial_ms = 10\n"
        + "retry_backoff_max_ms = 200\nretry_total_ms_max = 5000\n"
    )
    assert config.retry.policy() == squall.RetryPolicy(
        attempts_max=3, backoff_initial_ms=10, backoff_max_ms=200, total_ms_max=5000
    )


def test_example_file_spells_out_the_retry_defaults() -> None:
    assert load_config(DEPLOY / "cluster.example.toml").retry == RetryConfig()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("retry_attempts_max = -1", "retry.retry_attempts_max: must be from 0 to 100000, got -1"),
        (
            "retry_attempts_max = 100001",
            "retry.retry_attempts_max: must be from 0 to 100000, got 100001",
        ),
        (
            "retry_backoff_initial_ms = 0",
            "retry.retry_backoff_initial_ms: must be from 1 to 60000, got 0",
        ),
        (
            "retry_backoff_max_ms = 600001",
            "retry.retry_backoff_max_ms: must be from 1 to 600000, got 600001",
        ),
        (
            "retry_total_ms_max = -1",
            "retry.retry_total_ms_max: must be from 1 to 3600000, got -1",
        ),
        (
            "retry_attempts_max = true",
            "retry.retry_attempts_max: must be an integer, got true (a boolean)",
        ),
        (
            'retry_total_ms_max = "10s"',
            "retry.retry_total_ms_max: must be an integer, got '10s' (a string)",
        ),
    ],
)
def test_bad_retry_value(line: str, expected: str) -> None:
    assert error_of(VALID + f"[retry]\n{line}\n") == expected


def test_retry_backoff_must_start_below_its_cap() -> None:
    message = error_of(VALID + "[retry]\nretry_backoff_initial_ms = 2000\n")
    assert message == (
        "retry.retry_backoff_initial_ms: must not exceed retry.retry_backoff_max_ms (250), got 2000"
    )


def test_unknown_retry_key_suggests_the_right_one() -> None:
    message = error_of(VALID + "[retry]\nretry_attempt_max = 3\n")
    assert message == (
        "unknown key 'retry_attempt_max' in [retry]; did you mean 'retry_attempts_max'?"
    )
