"""`make test`'s runs (scripts/test_suites.sh), against a fake pytest: every run's failure,
the lint's included, fails the whole, and the lint's steps stop at the first that fails.

The lint runs beside the real-process tests rather than before them, so a broken lint is
only reported at the end: these tests make sure it is reported, and fails the run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test_suites.sh"

# Which run a pytest call is, from its arguments, and the exit code the test asks of it.
_FAKE_PYTEST = """#!/bin/bash
case "$*" in
    *--ignore=tests/unit*) run=real ;;
    *tests/unit*) run=unit ;;
    *tests/sim*) run=sim ;;
    *) run=other ;;
esac
echo "$run" >> "$RUNS_LOG"
echo "fake pytest: $run"
code_var="EXIT_$run"
exit "${!code_var:-0}"
"""


def _run(
    tmp_path: Path, *lint_steps: str, **exits: int
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    pytest = bin_dir / "pytest"
    pytest.write_text(_FAKE_PYTEST)
    pytest.chmod(0o755)
    runs = tmp_path / "runs.log"
    runs.write_text("")
    env = dict(os.environ, RUNS_LOG=str(runs), TMPDIR=str(tmp_path))
    env.update({f"EXIT_{name}": str(code) for name, code in exits.items()})
    result = subprocess.run(
        ["bash", str(SCRIPT), str(bin_dir), *lint_steps],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    return result, runs.read_text().split()


def test_every_run_passing_passes_and_the_lint_is_reported(tmp_path: Path) -> None:
    result, runs = _run(tmp_path, "echo ruff-ok", "echo mypy-ok")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(runs) == ["real", "sim", "unit"]
    assert "ruff-ok" in result.stdout and "mypy-ok" in result.stdout
    assert "lint: exit 0" in result.stdout
    # The scratch logs are removed.
    assert not list(tmp_path.glob("squall-*"))


def test_a_failing_lint_step_fails_the_run_and_the_steps_after_it_do_not_run(
    tmp_path: Path,
) -> None:
    result, runs = _run(tmp_path, "echo first-step", "false", "echo never-run")
    assert result.returncode != 0
    assert sorted(runs) == ["real", "sim", "unit"]
    assert "first-step" in result.stdout and "never-run" not in result.stdout
    assert "lint: exit 1" in result.stdout


def test_a_failing_real_process_or_simulator_run_fails_the_run(tmp_path: Path) -> None:
    real, _ = _run(tmp_path, "true", real=1)
    assert real.returncode != 0 and "real processes: exit 1" in real.stdout
    sims, _ = _run(tmp_path, "true", sim=5)
    assert sims.returncode != 0 and "simulators: exit 5" in sims.stdout


def test_failing_unit_tests_stop_the_run_with_their_code(tmp_path: Path) -> None:
    result, runs = _run(tmp_path, "echo lint-ran", unit=5)
    assert result.returncode == 5
    assert runs == ["unit"]
    assert "lint-ran" not in result.stdout


def test_no_lint_steps_is_a_usage_error(tmp_path: Path) -> None:
    result, runs = _run(tmp_path)
    assert result.returncode == 2
    assert "usage" in result.stderr and runs == []
