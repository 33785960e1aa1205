"""The transcript format shared by the scenario tests (etcd-raft's testdata style): parse,
render, and compare or rewrite.

A transcript is a list of blocks:

    # why this step matters (comments are kept)
    command args
    ----
    the output it produced

Each test module replays the commands on its own machine and passes the rendered output to
``check_or_rewrite``: with ``SQUALL_REWRITE=1`` in the environment it rewrites the file (review
the diff like code), otherwise it fails with a unified diff. Used by
``test_election_scenarios.py`` (``scenarios/*.txt``) and ``test_replica_scenarios.py``
(``scenarios/replica/*.txt``).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REWRITE = os.environ.get("SQUALL_REWRITE") == "1"


@dataclass
class Block:
    """One transcript block: its comments, command and expected output."""

    comments: list[str]
    command: str
    expected: list[str]


def parse_transcript(text: str) -> list[Block]:
    """Split a transcript file into blocks."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    comments: list[str] = []
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip():
            if comments and comments[-1] != "":
                comments.append("")
            continue
        if line.startswith("#"):
            comments.append(line)
            continue
        if i >= len(lines) or lines[i] != "----":
            raise ValueError(f"line {i}: command {line!r} is not followed by '----'")
        i += 1
        expected: list[str] = []
        while i < len(lines) and lines[i].strip():
            expected.append(lines[i])
            i += 1
        while comments and comments[-1] == "":
            comments.pop()
        blocks.append(Block(comments, line, expected))
        comments = []
    return blocks


def render(blocks: list[Block], outputs: list[list[str]]) -> str:
    """Write blocks back with the given outputs."""
    parts: list[str] = []
    for block, output in zip(blocks, outputs, strict=True):
        chunk = [*block.comments, block.command, "----", *output]
        parts.append("\n".join(chunk))
    return "\n\n".join(parts) + "\n"


def check_or_rewrite(path: Path, text: str, actual: str) -> None:
    """Rewrites the transcript under SQUALL_REWRITE=1; else fails if it differs."""
    if REWRITE:
        path.write_text(actual)
        return
    if actual != text:
        diff = "".join(
            difflib.unified_diff(
                text.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=f"{path.name} (expected)",
                tofile=f"{path.name} (actual)",
            )
        )
        pytest.fail(
            f"transcript {path.name} differs; if the change is intended, rerun with "
            f"SQUALL_REWRITE=1 and review the diff:\n{diff}"
        )
