"""Start-up permission checks (issue 9, item 5): a loose data directory or a private key
others can read is a WARNING that names the path, its mode and the fix; tight ones are
silent. Real files in a temporary directory; the modes are set with chmod."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from squall_server.common.file_checks import (
    check_data_dir,
    check_key_files,
    data_dir_problems,
    key_file_problems,
    make_private_dir,
)


def _dir(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o710])
def test_a_private_data_dir_passes_silently(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = _dir(tmp_path, mode)
    with caplog.at_level(logging.WARNING):
        assert check_data_dir(path, "replica n1") == []
    assert caplog.records == []


def test_a_world_writable_data_dir_is_a_warning_naming_path_mode_and_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _dir(tmp_path, 0o777)
    with caplog.at_level(logging.WARNING):
        problems = check_data_dir(path, "replica n1")
    assert len(problems) == 1
    assert "world-writable" in problems[0]
    assert "0777" in problems[0]
    assert f"chmod 700 {path}" in problems[0]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "replica n1 start-up check" in record.getMessage()
    assert str(path) in record.getMessage()


def test_group_writable_and_world_readable_data_dirs_are_warnings(tmp_path: Path) -> None:
    writable = _dir(tmp_path, 0o770)
    [problem] = data_dir_problems(writable)
    assert "group-writable" in problem and "0770" in problem
    os.chmod(writable, 0o755)
    [problem] = data_dir_problems(writable)
    assert "world-readable" in problem and "0755" in problem


def test_a_data_dir_that_is_a_file_or_missing_is_reported(tmp_path: Path) -> None:
    file = tmp_path / "data"
    file.write_text("")
    assert "not a directory" in data_dir_problems(file)[0]
    assert "cannot be checked" in data_dir_problems(tmp_path / "missing")[0]


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_key_only_its_owner_reads_passes(tmp_path: Path, mode: int) -> None:
    key = tmp_path / "n1.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    os.chmod(key, mode)
    assert check_key_files([key]) == []


@pytest.mark.parametrize(
    ("mode", "words"),
    [
        (0o644, "readable by other users"),
        (0o640, "readable by other users"),
        (0o604, "readable by other users"),
        (0o620, "open to other users"),
        (0o601, "open to other users"),
    ],
)
def test_a_key_with_any_group_or_other_bit_is_a_warning_with_chmod_600(
    tmp_path: Path, mode: int, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = tmp_path / "n1.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    os.chmod(key, mode)
    good = tmp_path / "n2.key"
    good.write_text("")
    os.chmod(good, 0o600)
    with caplog.at_level(logging.WARNING):
        problems = check_key_files([good, key], "gateway g1")
    assert len(problems) == 1
    assert words in problems[0]
    assert f"{mode:04o}" in problems[0]
    assert f"chmod 600 {key}" in problems[0]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "gateway g1 start-up check" in caplog.records[0].getMessage()


def test_a_missing_key_file_is_reported_not_raised(tmp_path: Path) -> None:
    [problem] = key_file_problems(tmp_path / "absent.key")
    assert "absent.key" in problem and "cannot be checked" in problem


def test_a_data_dir_squall_creates_is_private_and_an_existing_one_is_left_alone(
    tmp_path: Path,
) -> None:
    fresh = tmp_path / "a" / "b" / "n1"
    make_private_dir(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert data_dir_problems(fresh) == []
    existing = _dir(tmp_path, 0o755)
    make_private_dir(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755
