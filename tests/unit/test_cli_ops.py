"""The operator conventions of the `squall` command line: `config check`, shell
completion generated from the parser, and --json on every listing command."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import squall
from squall_server import cli
from squall_server.cli import listing as cli_listing
from tests.unit.test_cli import broker, run

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["broker"]  # the fake-broker fixture, shared with test_cli.py


# -- squall config check ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["single.toml", "cluster.example.toml", "container/cluster.toml"])
def test_config_check_accepts_the_shipped_configs(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(ROOT / "deploy" / name)
    code, out, err = run(["config", "check", path], capsys)
    assert (code, err) == (0, "")
    assert out.startswith(f"{path}: OK: cluster ") and "node(s)" in out and out.count("\n") == 1


def test_config_check_names_the_wrong_field_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "deploy" / "single.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text + "\n[timeouts]\nreplica_timeout_ms = -5\n")
    code, out, err = run(["config", "check", str(bad)], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"squall: config error: {bad}: ") and err.count("\n") == 1
    assert "replica_timeout_ms" in err
    # The very line a service prints for the same file (it exits 2 the same way).
    service = subprocess.run(
        [sys.executable, "-m", "squall_server.replica", "--config", str(bad), "--node", "n1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert (service.returncode, service.stderr) == (2, err)


def test_config_check_as_a_node_refuses_an_id_the_file_does_not_have(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = str(ROOT / "deploy" / "single.toml")
    code, _, err = run(["config", "check", path, "--node", "n9"], capsys)
    assert code == 2 and "unknown node id" in err and "n9" in err
    code, out, _ = run(["config", "check", path, "--node", "n1"], capsys)
    assert code == 0 and ": OK as node n1: " in out
    assert run(["config", "check", str(ROOT / "no-such.toml")], capsys)[0] == 2


# -- shell completion ---------------------------------------------------------------------

COMPLETE = """
source <("$SQUALL_PY" -m squall_server.cli completion bash)
complete_line() {
    COMP_WORDS=($1); [[ "$1" == *" " ]] && COMP_WORDS+=("")
    COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=(); _squall; echo "${COMPREPLY[*]}"
}
"""


def _complete(lines: list[str]) -> list[str]:
    script = COMPLETE + "".join(f"complete_line {json.dumps(line)}\n" for line in lines)
    result = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"SQUALL_PY": sys.executable, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_offers_commands_options_and_choices_from_the_parser() -> None:
    assert _complete(
        [
            "squall to",
            "squall topic ",
            "squall topic list --j",
            "squall subscribe t --from ",
            "squall completion ",
            "squall config check deploy/sin",
            "squall status --config deploy/cluster.ex",
            "squall store ",
        ]
    ) == [
        "topic",
        "create list destroy subscribers unsubscribe link unlink retry-link links info",
        "--json",
        "earliest latest",
        "bash zsh",
        "deploy/single.toml",
        "deploy/cluster.example.toml",
        "inspect mark-clean mark-dirty backup restore verify",
    ]


def test_every_command_of_the_parser_is_in_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["completion", "zsh"], capsys)
    assert code == 0 and out.startswith("autoload -U +X bashcompinit && bashcompinit\n")
    for path, parser in _commands(cli.build_parser()):
        if path:
            assert f"{' '.join(path)!r}) echo" in out or f"{path[0]}) echo" in out, path
        for action in parser._actions:
            for option in action.option_strings:
                assert option in out, (path, option)


# -- --json on listing commands -----------------------------------------------------------


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.extend(_commands(child, (*path, name)))
    return found


def test_every_listing_command_takes_json() -> None:
    listing = {("topic", "list"), ("topic", "subscribers"), ("status",), ("store", "inspect")}
    commands = dict(_commands(cli.build_parser()))
    for path in listing:
        options = {o for action in commands[path]._actions for o in action.option_strings}
        assert "--json" in options, path


def test_topic_list_json(broker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run(["topic", "create", "orders"], capsys)
    run(["topic", "create", "live", "--transient"], capsys)
    code, out, _ = run(["topic", "list", "--json"], capsys)
    assert code == 0
    topics = json.loads(out)["topics"]
    assert [(t["name"], t["kind"], t["first_offset"], t["next_offset"]) for t in topics] == [
        ("live", "transient", 0, 0),
        ("orders", "replicated", 0, 0),
    ]
    assert all(isinstance(t["created_ms"], int) for t in topics)


def test_subscribers_json_spells_out_the_qos() -> None:
    info = squall.PushSubscriberInfo(
        topic="t",
        subscriber_id="s1",
        endpoint="127.0.0.1:9",
        qos={"reliability": "ordered", "retryCount": "3"},
        cursor=7,
        created_ms=1,
        consecutive_failures=2,
        last_error="UNAVAILABLE",
    )
    document = cli_listing.subscribers_document("t", [info])
    assert json.loads(json.dumps(document)) == {
        "topic": "t",
        "subscribers": [
            {
                "topic": "t",
                "subscriber_id": "s1",
                "endpoint": "127.0.0.1:9",
                "qos": {"reliability": "ordered", "retryCount": "3"},
                "cursor": 7,
                "created_ms": 1,
                "consecutive_failures": 2,
                "last_error": "UNAVAILABLE",
                "retry_count": 3,
                "ordered": True,
            }
        ],
    }
