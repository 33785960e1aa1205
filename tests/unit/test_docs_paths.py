"""Docs cite files that exist: every repository path named in the Markdown pages, and
every Markdown page named in the code, is in the repository (a renamed or never-added
file — `deploy/cluster.toml`, `STYLE.md` — fails here, not in a reader's hands)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        *ROOT.glob("*.md"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "examples" / "README.md",
        ROOT / "bench" / "README.md",
    ]
)
CODE_DIRS = ("services", "clients/squall", "deploy", "chaos", "bench", "scripts", "tests")
# A relative path with a directory, ending in a file type the repository holds. Not
# preceded by a path character, so /etc/squall/cluster.toml and ~/.x do not match.
PATH = re.compile(
    r"(?<![\w./~$-])((?:[\w-][\w.-]*/)+[\w.-]+\.(?:md|py|toml|yaml|yml|proto|sh|service|target|conf))\b"
)
MARKDOWN_NAME = re.compile(r"(?<![\w./~$-])((?:[\w-][\w.-]*/)*[A-Za-z][\w.-]*\.md)\b")
# Written at run time, not kept in the repository.
GENERATED = (".run/", "bench/results/")
# Files the code writes, named in it (the benchmark report's report.md).
WRITTEN = {"report.md"}


def _exists(path: str, near: Path) -> bool:
    bases = (ROOT, near, ROOT / "docs", ROOT / "protos", ROOT / "clients")
    return any((base / path).exists() for base in bases)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page: Path) -> None:
    text = page.read_text()
    missing = sorted(
        {
            path
            for path in PATH.findall(text)
            if not path.startswith(GENERATED) and not _exists(path, page.parent)
        }
    )
    assert not missing, f"{page.relative_to(ROOT)} names files not in the repository: {missing}"


def test_every_markdown_page_the_code_cites_exists() -> None:
    missing = []
    for directory in CODE_DIRS:
        for source in (ROOT / directory).rglob("*.py"):
            if "/v1/" in str(source):
                continue  # generated stubs
            for name in set(MARKDOWN_NAME.findall(source.read_text())):
                if name in WRITTEN or name.startswith(GENERATED):
                    continue
                if not _exists(name, source.parent):
                    missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, missing
