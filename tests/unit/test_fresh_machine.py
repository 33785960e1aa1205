"""A fresh machine as a newcomer meets it: scripts/venv.sh (what `make install` and
`make run` call) refuses an old Python with the version to install, rebuilds a .venv a
failed attempt left half-made, writes its stamp only after every step succeeded and never
re-points a venv another checkout installed into; and
what `make run` starts imports nothing from the dev or spark extras."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "venv.sh"

# Answers `-c CODE` the way a Python 3.9 would (the script asks the version that way).
OLD_PYTHON = f"""#!/bin/sh
[ "$1" = "-c" ] && exec {sys.executable} -c "import sys; sys.version_info = (3, 9, 1); $2"
exit 1
"""


def _venv_sh(cwd: Path, python: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), python, ".venv", "", "stamp"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_an_old_python_is_refused_naming_the_version_to_install(tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text(OLD_PYTHON)
    old.chmod(0o755)
    result = _venv_sh(tmp_path, str(old))
    assert result.returncode == 1
    assert "is Python 3.9; Squall needs Python 3.11 or later" in result.stderr
    assert "make PYTHON=python3.11" in result.stderr
    assert not (tmp_path / ".venv").exists() and not (tmp_path / "stamp").exists()


def test_a_missing_python_is_named(tmp_path: Path) -> None:
    result = _venv_sh(tmp_path, "no-such-python3")
    assert result.returncode == 1
    assert "no 'no-such-python3' on PATH" in result.stderr


def test_a_half_made_venv_is_rebuilt_and_a_failed_install_writes_no_stamp(
    tmp_path: Path,
) -> None:
    # What an interrupted `python -m venv` leaves: the directory, no working interpreter.
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    # No pyproject.toml or constraints.txt here: the install step fails after the rebuild.
    result = _venv_sh(tmp_path, sys.executable)
    assert "incomplete or broken" in result.stderr and "rebuilding it" in result.stderr
    assert result.returncode != 0
    rebuilt = tmp_path / ".venv" / "bin" / "python"
    check = subprocess.run(
        [str(rebuilt), "-m", "pip", "--version"], capture_output=True, timeout=60, check=False
    )
    assert check.returncode == 0, "the rebuilt venv has a working pip"
    assert not (tmp_path / "stamp").exists(), "a failed install must not be marked done"
    # The venv works now, but the install into it did not finish: not reused either.
    again = _venv_sh(tmp_path, sys.executable)
    assert "the last install into .venv did not finish; rebuilding it" in again.stderr
    assert again.returncode != 0 and not (tmp_path / "stamp").exists()


# A venv's python that answers the script's checks and refuses to install anything, so
# the test can never touch a real environment even if the refusal below broke.
CHECK_ONLY_PYTHON = f"""#!/bin/sh
[ "$1" = "-c" ] && exec {sys.executable} -c "$2"
[ "$1 $2 $3" = "-m pip --version" ] && exec {sys.executable} -m pip --version
exit 1
"""


def test_a_venv_another_checkout_installed_into_is_not_re_pointed(tmp_path: Path) -> None:
    # A git worktree sharing the main checkout's venv through a link: installing from the
    # worktree would make the main checkout's tests and services load the worktree's code.
    other = tmp_path / "main"
    (other / "services").mkdir(parents=True)
    venv = other / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(CHECK_ONLY_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    finder = site / "__editable___squall_server_0_1_0_finder.py"
    mapping = f"MAPPING: dict[str, str] = {{'squall_server': '{other}/services'}}\n"
    finder.write_text(mapping)
    worktree = tmp_path / "worktree"
    worktree.mkdir()
    (worktree / ".venv").symlink_to(venv)
    result = _venv_sh(worktree, sys.executable)
    assert result.returncode == 1
    assert f"holds the editable install of the checkout at {other}" in result.stderr
    assert f"Run make in {other}" in result.stderr
    assert finder.read_text() == mapping
    assert not (worktree / "stamp").exists() and not (venv / ".incomplete").exists()
    # A checkout that moved (the directory the venv names is gone) may take its venv along.
    (other / "services").rmdir()
    moved = _venv_sh(worktree, sys.executable)
    assert "holds the editable install" not in moved.stderr


def test_make_run_installs_the_base_only_and_the_makefile_says_so() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "run: install-run bytecode\n" in makefile and "stop: install-run\n" in makefile
    assert "bytecode: install-run\n" in makefile  # compiling needs no more than the base
    assert "venv.sh '$(PYTHON)' $(VENV) '' $(RUN_STAMP)" in makefile


def test_what_make_run_starts_imports_nothing_from_the_dev_or_spark_extras() -> None:
    # A finder that fails any import of the extras' packages, then everything `make run`
    # runs: the launcher (with its demo and status table) and the three services.
    code = """
import sys
BLOCKED = {"pyspark", "pyarrow", "matplotlib", "mypy", "yaml", "hypothesis", "pytest"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not in the base install")
        return None
sys.meta_path.insert(0, Block())
import deploy.launcher, deploy.processes, squall_server.cli, squall_server.cli.cluster_shutdown
import squall_server.common.dev_certs
import squall_server.replica.__main__, squall_server.coordinator.__main__
import squall_server.gateway.__main__
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
