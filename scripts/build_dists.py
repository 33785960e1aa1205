"""Builds Squall's two wheels: the client `squall` and the server `squall-server`.

    python scripts/build_dists.py DEST        (`make dist` writes them to dist/)

The client is clients/pyproject.toml; the server is the root's pyproject.toml and setup.py,
which install the code of services/ as `squall_server`. Both are built from a copy of the
files they are made of (what git tracks or would track there), so the work tree gets no
build/ or .egg-info litter and nothing .gitignore names (caches, a local .venv) slips in.
The build runs offline with this interpreter's setuptools (no build isolation): the dev
extra installs it. Prints the paths of the wheels it wrote.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the server's build reads, besides services/; the client's is all of clients/.
SERVER_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
BUILD_TIMEOUT_S = 300


def _tracked(under: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", under],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name]


def _copy(names: list[str], into: Path) -> None:
    for name in names:
        source, target = ROOT / name, into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # clients/LICENSE -> ../LICENSE: the release gets the text
            shutil.copy(source.resolve(), target)
        elif source.is_file():
            shutil.copy(source, target)


def build(dest: Path) -> list[Path]:
    """Builds both wheels into dest (created if missing, older ones replaced); their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="squall-dist-") as scratch:
        tree, wheels = Path(scratch) / "tree", Path(scratch) / "wheels"
        _copy([*_tracked("clients"), *_tracked("services"), *SERVER_FILES], tree)
        for project, what in ((tree / "clients", "the client"), (tree, "the server")):
            result = subprocess.run(
                [
                    *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
                    *("--no-build-isolation", "--no-index", "--wheel-dir", str(wheels)),
                    str(project),
                ],
                cwd=tree,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if result.returncode != 0:
                raise SystemExit(f"building {what} failed:\n{result.stdout}{result.stderr}")
        built = []
        for wheel in sorted(wheels.glob("*.whl")):
            target = dest / wheel.name
            target.unlink(missing_ok=True)
            shutil.move(wheel, target)
            built.append(target)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder the wheels go to")
    args = parser.parse_args(argv)
    for wheel in build(args.dest):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
