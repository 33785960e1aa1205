"""Renames the server's import name from `services` to `squall_server` across the tree.

The server's code stays in the folders `services/coordinator`, `services/replica`, ...;
what changes is the name it is imported by, so that an installed server puts
`squall_server` in site-packages rather than the generic `services` (issue 17 item 1).
The repository keeps a symlink `squall_server -> services` so the tree imports, type-checks
and runs under the new name without an install; the server's wheel maps the same folder.

What is rewritten, in every file git tracks (but the generated protobuf code, recorded
benchmark results and the changelog's history):

* dotted references to a module of the server: `services.replica.node` ->
  `squall_server.replica.node` (imports, `python -m`, mock targets, docs, systemd units);
  only the server's own top-level modules are matched, so `self.services.values()` or a
  variable named `services` stay as they are;
* `from services import X`, `import services`, `python -m services`, and the argv form
  `"-m", "services"` (over line breaks too);
* the module-name prefix `"services."` as a string, and the ruff first-party list.

File paths (`services/replica/node.py`) are left alone: the folders do not move. The
imports of the Python files it changed are then re-sorted with ruff (`squall_server` sorts
after `squall`), the project's linter (the .venv's, else one on PATH). The script is
idempotent: run again after merging branches that still say `services.`, it rewrites only
what is new.

    python3 scripts/rename_server_package.py          # rewrite, print the files changed
    python3 scripts/rename_server_package.py --check  # exit 1 if anything is left to rename
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD = "services"
NEW = "squall_server"
# Not rewritten: generated code, measurements of the past, the changelog's history, and
# this script (which names both).
SKIPPED_PREFIXES = ("clients/squall/v1/", "bench/results/", "CHANGELOG.md", "scripts/rename_")


def _submodules() -> list[str]:
    """The server's top-level modules and packages (`cli`, `common`, `replica`, ...)."""
    names = []
    for entry in sorted((ROOT / OLD).iterdir()):
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names.append(entry.name)
        elif entry.suffix == ".py":
            names.append(entry.stem)
    return [*names, "__file__", "__path__"]


def rules() -> list[tuple[re.Pattern[str], str]]:
    """(pattern, replacement) pairs, applied in order."""
    modules = "|".join(re.escape(name) for name in _submodules())
    return [
        # services.replica.node, "services.cli:main", -m services.coordinator
        (re.compile(rf"(?<![\w./-]){OLD}\.(?=(?:{modules})\b)"), f"{NEW}."),
        (re.compile(rf"\bfrom {OLD} import\b"), f"from {NEW} import"),
        (re.compile(rf"(?<![\w.])import {OLD}\b(?![\w.])"), f"import {NEW}"),
        # `python -m services ...` in prose, shell and unit files
        (re.compile(rf"(-m\s+){OLD}\b(?![\w./-])"), rf"\1{NEW}"),
        # [sys.executable, "-m", "services", ...] and _run("-m", "services", ...)
        (re.compile(rf"""((["'])-m\2,\s*)(["']){OLD}\3"""), rf"\1\3{NEW}\3"),
        # a module-name prefix as a string: name.startswith("services."), f"services.{kind}"
        (re.compile(rf"""(["']){OLD}\.(["'{{])"""), rf"\1{NEW}.\2"),
        # ruff's known-first-party list in pyproject.toml
        (re.compile(rf'(known-first-party = \[[^\]]*)"{OLD}"'), rf'\1"{NEW}"'),
    ]


def _tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    paths = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if name.startswith(SKIPPED_PREFIXES) or path.is_symlink() or not path.is_file():
            continue
        paths.append(path)
    return paths


def rename(text: str, compiled: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, replacement in compiled:
        text = pattern.sub(replacement, text)
    return text


def _sort_imports(paths: list[str]) -> None:
    """Re-sorts the imports of the files given (ruff's isort rules, pyproject.toml's config)."""
    ruff = ROOT / ".venv" / "bin" / "ruff"
    command = str(ruff) if ruff.is_file() else shutil.which("ruff")
    if command is None:
        print("no ruff: run `ruff check --select I --fix` on the files above", file=sys.stderr)
        return
    subprocess.run(
        [command, "check", "--quiet", "--select", "I", "--fix", *paths], cwd=ROOT, check=False
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if due")
    args = parser.parse_args(argv)
    compiled = rules()
    due = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        renamed = rename(text, compiled)
        if renamed != text:
            due.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(renamed, encoding="utf-8")
    link = ROOT / NEW
    if not link.is_symlink():
        due.append(Path(NEW))
        if not args.check:
            os.symlink(OLD, link, target_is_directory=True)
    for name in due:
        print(name)
    python_files = [str(name) for name in due if name.suffix == ".py"]
    if python_files and not args.check:
        _sort_imports(python_files)
    if args.check and due:
        print(f"{len(due)} file(s) still use the import name {OLD!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
