"""The `squall` command line, run through `main([...])` against test_client.py's fake broker."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import squall
from squall.v1 import common_pb2
from squall_server import cli


def _load_fakes() -> types.ModuleType:
    # Loaded by path so it works whatever pytest's import mode and rootdir are.
    path = Path(__file__).with_name("test_client.py")
    spec = importlib.util.spec_from_file_location("squall_test_fakes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


fakes = _load_fakes()


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    fake = fakes.FakeBroker()
    server, address = fakes.serve_fake(fake)
    fake.address = address
    monkeypatch.setenv(cli.GATEWAY_ENV, address)
    try:
        yield fake
    finally:
        server.stop(grace=None)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_topic_commands(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    created = run(["topic", "create", "orders"], capsys)
    assert created == (0, "created replicated topic orders\n", "")
    assert run(["topic", "create", "live", "--transient"], capsys)[1] == (
        "created transient topic live\n"
    )
    code, out, _ = run(["topic", "list"], capsys)
    assert code == 0
    assert out.splitlines() == [
        "live\ttransient\tfirst_offset=0\tnext_offset=0\tsize_bytes=n/a",
        "orders\treplicated\tfirst_offset=0\tnext_offset=0\tsize_bytes=0",
    ]
    code, out, _ = run(["topic", "list", "--json"], capsys)
    sizes = {t["name"]: t["size_bytes"] for t in json.loads(out)["topics"]}
    assert sizes == {"live": None, "orders": 0}
    assert run(["topic", "destroy", "orders"], capsys)[:2] == (0, "destroyed topic orders\n")
    code, out, err = run(["topic", "destroy", "orders"], capsys)
    assert (code, out) == (1, "")
    assert err.startswith("squall: ") and "NOT_FOUND" in err and err.count("\n") == 1


def test_topic_link_commands(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "a"], capsys)
    run(["topic", "create", "b"], capsys)
    assert run(["topic", "link", "a", "b", "--cost", "3"], capsys)[:2] == (
        0,
        "linked topic a to b with cost 3 (forwarding from offset 0 as squall-link/1)\n",
    )
    linked = run(["topic", "link", "a", "orders", "--cluster", "site-b"], capsys)[1]
    assert linked.startswith("linked topic a to orders@site-b with cost 0")
    code, out, _ = run(["topic", "links", "a"], capsys)
    assert code == 0 and out.splitlines() == [
        "a -> b\tcost=3\tnext_offset=0\tlag_events=0\tlag_ms=0\tpublisher_id=squall-link/1",
        "a -> orders@site-b\tcost=0\tnext_offset=0\tlag_events=0\tlag_ms=0"
        "\tpublisher_id=squall-link/2",
    ]
    code, out, _ = run(["topic", "info", "a"], capsys)
    assert out.splitlines()[0] == (
        "a\treplicated\tfirst_offset=0\tnext_offset=0\tsize_bytes=0\tlinks=2"
    )
    code, out, _ = run(["topic", "info", "a", "--json"], capsys)
    document = json.loads(out)
    assert document["name"] == "a" and document["size_bytes"] == 0
    assert [x["to_topic"] for x in document["links"]] == [
        "b",
        "orders",
    ]
    broker.links[1].stopped_reason = "stopped at offset 0 (...): NOT_FOUND"
    code, out, _ = run(["topic", "links", "a"], capsys)
    assert out.splitlines()[1].endswith("\tSTOPPED: stopped at offset 0 (...): NOT_FOUND")
    code, out, _ = run(["topic", "links", "--json"], capsys)
    assert json.loads(out)["links"][1]["stopped_reason"].endswith("NOT_FOUND")
    assert run(["topic", "unlink", "a", "orders", "--cluster", "site-b"], capsys)[1] == (
        "unlinked topic a from orders@site-b\n"
    )
    code, out, _ = run(["topic", "links", "--json"], capsys)
    assert [x["to_topic"] for x in json.loads(out)["links"]] == ["b"]
    code, _, err = run(["topic", "unlink", "a", "orders"], capsys)
    assert code == 1 and "NOT_FOUND" in err


def test_publish_arguments_and_subscribe(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "t"], capsys)
    code, out, _ = run(["publish", "t", "hello", "wörld", "--key", "k1"], capsys)
    assert code == 0
    assert out.splitlines() == ["offset=0 lsn=1 epoch=7", "offset=1 lsn=2 epoch=7"]
    code, out, _ = run(["subscribe", "t"], capsys)
    assert code == 0
    assert out.splitlines() == ["0\tk1\thello", "1\tk1\twörld"]


def test_publish_stdin_lines(
    broker: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run(["topic", "create", "t"], capsys)
    lines = b"".join(b"line %d\n" % i for i in range(300)) + b"last\r\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
    code, out, _ = run(["publish", "t", "--publisher-id", "cli-1"], capsys)
    assert code == 0
    assert out.splitlines() == [f"offset={i} lsn={i + 1} epoch=7" for i in range(301)]
    events = broker.topics["t"].events
    assert [e.payload for e in events[:2]] == [b"line 0", b"line 1"]
    assert events[-1].payload == b"last"
    assert {e.publisher_id for e in events} == {"cli-1"}
    assert [e.sequence for e in events] == list(range(1, 302))


def test_publish_same_id_is_deduplicated(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "t"], capsys)
    run(["publish", "t", "a", "--publisher-id", "job"], capsys)
    code, out, _ = run(["publish", "t", "a", "--publisher-id", "job"], capsys)
    assert (code, out) == (0, "offset=0 lsn=1 epoch=7 duplicate=true\n")


def test_subscribe_escapes_and_count(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "t"], capsys)
    with fakes.squall.connect(broker.address) as client:
        with client.topic("t").publisher() as publisher:
            publisher.publish_many([(b"", b"tab\there"), (b"\xff", b"back\\slash\n"), b"x", b"y"])
    code, out, _ = run(["subscribe", "t", "--count", "2"], capsys)
    assert code == 0
    assert out == "0\t\ttab\\there\n1\t\\xff\tback\\\\slash\\n\n"
    assert run(["subscribe", "t", "--from", "3"], capsys)[1] == "3\t\ty\n"
    assert run(["subscribe", "t", "--from", "latest"], capsys)[1] == ""


def test_durable_subscribe_acks(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "t"], capsys)
    run(["publish", "t", "a", "b", "c"], capsys)
    out = run(["subscribe", "t", "--subscription", "s", "--count", "2"], capsys)[1]
    assert out.splitlines() == ["0\t\ta", "1\t\tb"]
    assert broker.topics["t"].cursors == {"s": 2}
    assert run(["subscribe", "t", "--subscription", "s"], capsys)[1] == "2\t\tc\n"
    assert broker.topics["t"].cursors == {"s": 3}


def test_subscribe_follow_with_count_stops(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "t"], capsys)
    run(["publish", "t", "a", "b"], capsys)
    code, out, _ = run(["subscribe", "t", "--follow", "--count", "2"], capsys)
    assert (code, out) == (0, "0\t\ta\n1\t\tb\n")


def test_status_table_and_json(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    broker.status.nodes.add(
        node_id="n1",
        coordinator_id="n1",
        group_name="n1:abc",
        state=common_pb2.NODE_STATE_NORMAL,
        group=["n2"],
        max_seen=2,
        epoch=7,
        role=common_pb2.ROLE_MASTER,
        last_change_reason="won election",
        reachable=True,
        priority=3,
        quorum_required=1,
        quorum_override=1,
    )
    broker.status.nodes.add(node_id="n2", reachable=False, error="connection refused")
    code, out, _ = run(["status"], capsys)
    assert code == 0
    assert out.splitlines() == [
        "id  prio  coord  group name  state        group  max  epoch  role    quorum"
        "          reason",
        "n1  3     n1     n1:abc      normal       n2     2    7      master  1 (OVERRIDE 1)"
        "  won election",
        "n2  -     -      -           unreachable  -      -    -      -       -"
        "               connection refused",
        f"master: n1  epoch: 7  (squall {squall.__version__})",
    ]
    code, out, _ = run(["status", "--json"], capsys)
    data = json.loads(out)
    assert data["master_id"] == "n1"
    assert [n["node_id"] for n in data["nodes"]] == ["n1", "n2"]
    assert data["nodes"][0]["state"] == "normal"


def test_status_says_how_long_ago_the_master_heard_each_slave(
    broker: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A slave whose replica the master cannot reach (its links alone cut) shows as long
    silent while everything else looks well."""
    node = broker.status.nodes.add(
        node_id="n1",
        coordinator_id="n1",
        state=common_pb2.NODE_STATE_NORMAL,
        role=common_pb2.ROLE_MASTER,
        reachable=True,
    )
    node.slaves.add(node_id="n2", state="streaming", written_lsn=9, silent_ms=3200)
    node.slaves.add(node_id="n3", state="streaming", written_lsn=9, silent_ms=40, catching_up=True)
    code, out, _ = run(["status"], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["slave"][-1] == "heard"
    assert rows["n2"][-2:] == ["3.2s", "ago"] and rows["n3"][-1] == "now"
    # A slave not yet caught up says so.
    assert rows["n3"][1:4] == ["streaming", "(catching", "up)"]
    assert rows["n2"][1:3] == ["streaming", "9"]


def _cluster_toml(gateway_address: str | None) -> str:
    text = (
        '[cluster]\nname = "test"\n\n[[nodes]]\nid = "n1"\npriority = 1\n'
        'coordinator_address = "127.0.0.1:1"\nreplica_address = "127.0.0.1:2"\n'
        'data_dir = "data/n1"\n'
    )
    if gateway_address is not None:
        text += f'\n[[gateways]]\nid = "g1"\naddress = "{gateway_address}"\n'
    return text


def test_gateway_resolution(
    broker: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run(["topic", "create", "t"], capsys)
    port = broker.address.rsplit(":", 1)[1]
    config = tmp_path / "cluster.toml"
    # --config wins over the environment, which points nowhere useful here.
    monkeypatch.setenv(cli.GATEWAY_ENV, "127.0.0.1:1")
    config.write_text(_cluster_toml(f"127.0.0.1:{port}"))
    assert run(["topic", "list", "--config", str(config)], capsys)[0] == 0
    # A valid file (its [tls] is read) whose gateway is not there: --gateway wins.
    config.write_text(_cluster_toml("127.0.0.1:3"))
    assert (
        run(["topic", "list", "--config", str(config), "--gateway", broker.address], capsys)[0] == 0
    )
    config.write_text(_cluster_toml(None))
    code, _, err = run(["topic", "list", "--config", str(config)], capsys)
    assert code == 2 and err.startswith(f"squall: config error: {config}: ") and "gateways" in err
    code, _, err = run(["topic", "list", "--config", str(tmp_path / "missing.toml")], capsys)
    assert code == 2 and "cannot read" in err
    config.write_text("not [toml")
    assert run(["topic", "list", "--config", str(config)], capsys)[0] == 2


def test_default_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.GATEWAY_ENV, raising=False)
    args = cli.build_parser().parse_args(["status"])
    assert cli.resolve_gateway(args) == "127.0.0.1:7100"
    monkeypatch.setenv(cli.GATEWAY_ENV, "10.0.0.5:7000")
    assert cli.resolve_gateway(args) == "10.0.0.5:7000"


@pytest.mark.parametrize("name", ["single.toml", "cluster.example.toml"])
def test_the_default_gateway_is_the_one_the_shipped_configs_use(name: str) -> None:
    from squall_server.common.config import load_config

    root = Path(__file__).resolve().parents[2]
    assert load_config(root / "deploy" / name).gateway().address == cli.DEFAULT_GATEWAY


def test_unreachable_gateway_is_one_line_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with fakes.socket_free_port() as address:
        code, out, err = run(["topic", "list", "--gateway", address, "--timeout", "2"], capsys)
    assert (code, out) == (1, "")
    assert err.startswith("squall: ") and err.endswith("(UNAVAILABLE)\n") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["topic"],
        ["subscribe", "t", "--from", "yesterday"],
        ["subscribe", "t", "--count", "0"],
        ["topic", "list", "--bogus"],
        ["replica", "--node", "n1"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(argv, capsys)
    assert code == 2
    assert "squall" in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "subscribe" in out


def test_service_commands_forward_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    module = types.ModuleType("squall_server.replica.__main__")

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    module.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "squall_server.replica.__main__", module)
    argv = ["replica", "--config", "c.toml", "--node", "n1", "--log-level", "debug"]
    assert cli.main(argv) == 3
    assert seen == [["--config", "c.toml", "--node", "n1", "--log-level", "debug"]]


def test_missing_service_is_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    code, _, err = run(["gateway", "--config", "c.toml"], capsys)
    assert code == 1
    assert err == (
        "squall: the gateway service is not installed (squall_server.gateway.__main__ not found)\n"
    )


def test_grpc_status_codes_reach_the_user(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "t"], capsys)
    code, _, err = run(["topic", "create", "t"], capsys)
    assert code == 1 and grpc.StatusCode.ALREADY_EXISTS.name in err


def test_raw_stubs_example_runs(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "raw_stubs_app.py"
    spec = importlib.util.spec_from_file_location("raw_stubs_app", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for _ in range(2):  # the second run finds the topic already there
        assert example.main(["--gateway", broker.address, "--topic", "demo"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "topic demo: next_offset=0"
    assert "published offset=0 lsn=1 epoch=7 duplicate=False holders=1" in out
    assert out[-1] == "read 10 events"
    assert "9\tkey-5\thello #5 from raw stubs" in out[-2]
