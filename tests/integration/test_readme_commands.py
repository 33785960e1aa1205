"""The README's commands and code, run: what a newcomer copies from it works as shown.

Which README blocks are checked where:

* *Using it from Python*, the replicated publisher and the push subscriber snippets: run
  here, each in a fresh interpreter, against a real one-node cluster the three share (the
  address 127.0.0.1:7100 swapped for the test cluster's gateway; the topic "orders" renamed
  to one of each snippet's own; the 100,000-event batch cut to 1,000 to keep the test short;
  the two fragments get a prelude defining what they take from the text around them:
  `topic`, `log`, `handle`).
* *The command line*: every command of the synopsis is a real command of `squall`, with
  the options shown (checked here against the parser); the client commands themselves
  run in tests/integration/test_cli_smoke.py, the operator ones in
  tests/unit/test_cli*.py, tests/unit/test_store_backup.py and the deployment tests.
* *Two commands*: `make run` / `make stop` is tests/integration/test_launcher.py;
  `make test` is CI itself.
* *Spark*: the same calls run in tests/spark/ (they need Java).
* Every `squall COMMAND ...` line in a shell block of README.md, examples/README.md,
  bench/README.md and docs/*.md names a real command with real options (checked here).
  The `make` targets they show are the Makefile's; `python -m bench...` runs are
  benchmarks (bench/README.md), and the systemd, docker and backup procedures of
  docs/deployment.md are run by tests/integration/test_deploy_commands.py and
  test_deployment_procedures.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from squall_server import cli
from tests.integration.conftest import ROOT, LocalCluster

README = (ROOT / "README.md").read_text()
DOC_GATEWAY = "127.0.0.1:7100"


def _fenced(text: str) -> list[tuple[str, str]]:
    """Every fenced block of a Markdown text as (language, body), fences paired in order."""
    blocks: list[tuple[str, str]] = []
    language: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body) + "\n"))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def _blocks(language: str) -> list[str]:
    return [body for lang, body in _fenced(README) if lang == language]


def _python_block(containing: str) -> str:
    matches = [block for block in _blocks("python") if containing in block]
    assert len(matches) == 1, f"README has {len(matches)} python blocks with {containing!r}"
    return matches[0]


PRELUDE = """
import logging
import squall
log = logging.getLogger("readme")
received = []
def handle(messages):
    received.extend(messages)
client = squall.connect({gateway!r})
try:
    client.create_topic("orders")
except squall.AlreadyExists:
    pass
topic = client.topic("orders")
"""

SNIPPETS = {
    # name: (text that finds the block in README, needs the prelude, what it prints)
    "using-it-from-python": ('with squall.connect("127.0.0.1:7100")', False),
    "replicated-publisher": ("replicated=True, on_rebind=moved", True),
    "push-subscriber": ("with squall.PushEndpoint() as endpoint:", True),
}


def _run_snippet(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        check=False,
    )


@pytest.mark.parametrize("name", list(SNIPPETS))
def test_the_readme_python_snippets_run_against_a_cluster(
    name: str, shared_single: LocalCluster, tmp_path: Path
) -> None:
    containing, prelude = SNIPPETS[name]
    block = _python_block(containing).replace(DOC_GATEWAY, shared_single.gateway_address)
    block = block.replace("range(100_000)", "range(1_000)")
    code = PRELUDE.format(gateway=shared_single.gateway_address) if prelude else ""
    code += textwrap.dedent(block)
    # Each snippet its own topic on the shared cluster (the first creates it and reads it
    # from offset 0).
    assert '"orders"' in code, f"the README's {name} snippet no longer names its topic orders"
    code = code.replace('"orders"', f'"orders-{name}"')
    if name == "using-it-from-python":
        # What it printed: the receipt, then every event the subscription read.
        result = _run_snippet(code, tmp_path)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert re.fullmatch(r"0 \d+ \d+", lines[0]), lines[:3]
        assert lines[1] == "0 b'one'" and lines[-1] == "1000 b'event 999'"
        assert len(lines) == 1 + 1001
        return
    if name == "push-subscriber":
        code += "\nprint('unsubscribed', [s.subscriber_id for s in topic.push_subscribers()])\n"
    result = _run_snippet(code, tmp_path)
    assert result.returncode == 0, result.stderr
    if name == "push-subscriber":
        assert result.stdout.strip() == "unsubscribed []"


def _synopsis() -> list[list[str]]:
    """The README's command-line block, as argv lists (comments and alternatives split)."""
    block = next(b for b in _blocks("sh") if "squall replica" in b)
    commands = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        for part in line.split(" | "):
            words = part.split()
            if words and words[0] == "squall":
                commands.append(words[1:])
            elif words and commands:  # `... | unquarantine ID` continues the same group
                commands.append([commands[-1][0], *words])
    return commands


def _command_parser(words: list[str]) -> tuple[list[str], object]:
    import argparse

    parser: argparse.ArgumentParser = cli.build_parser()
    path: list[str] = []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        path.append(word)
    return path, parser


def test_every_command_in_the_readme_synopsis_exists_with_its_options() -> None:
    import argparse

    synopsis = _synopsis()
    assert len(synopsis) >= 25, synopsis
    for words in synopsis:
        if words and words[0].startswith("--"):  # `squall --version`
            assert words[0] in {o for a in cli.build_parser()._actions for o in a.option_strings}
            continue
        path, parser = _command_parser(words)
        assert isinstance(parser, argparse.ArgumentParser)
        assert path, f"`squall {' '.join(words)}`: no such command"
        options = {o for action in parser._actions for o in action.option_strings}
        for word in words[len(path) :]:
            option = word.strip("[]").split("=")[0]
            if option.startswith("--"):
                assert option in options, f"`squall {' '.join(words)}`: no option {option}"


DOC_PAGES = [
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]


def _doc_command_lines() -> list[tuple[str, list[str]]]:
    """Every `squall COMMAND ...` in a shell block of the docs, as (page, argv)."""
    import argparse

    top = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for page in DOC_PAGES:
        text = page.read_text()
        for language, block in _fenced(text):
            if language not in ("", "sh", "bash", "shell", "console"):
                continue
            for line in block.splitlines():
                line = line.split(" #", 1)[0]
                for match in re.finditer(r"(?:^|[\s/'\"(])squall\s+(\S.*)$", line):
                    words = match.group(1).replace("'", " ").replace('"', " ").split()
                    if words[0] in top.choices:
                        found.append((page.name, words))
    return found


def test_every_squall_command_in_the_docs_exists_with_its_options() -> None:
    """The docs' shell blocks (README, examples, bench, docs/*.md) name only commands and
    options `squall` has: a renamed option fails here rather than in an operator's shell."""
    import argparse

    lines = _doc_command_lines()
    assert len(lines) >= 40, len(lines)  # 50 when written
    for page, words in lines:
        path, parser = _command_parser(words)
        assert isinstance(parser, argparse.ArgumentParser)
        options = {o for action in parser._actions for o in action.option_strings}
        for word in words[len(path) :]:
            option = word.strip("[]").split("=")[0]
            if re.fullmatch(r"--[a-z][a-z-]*", option):
                assert option in options, f"{page}: `squall {' '.join(words)}`: no {option}"
