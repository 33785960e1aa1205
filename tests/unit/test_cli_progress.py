"""The progress line of `squall store backup|restore|verify` (services/cli/progress.py),
and `squall store verify` on real LMDB backups."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from squall_server.cli.progress import LOG_INTERVAL_S, ProgressLine
from squall_server.common.clock import ManualClock
from squall_server.replica import backup
from tests.unit.test_store_backup import run, source

__all__ = ["source"]  # the filled-store fixture, shared with test_store_backup.py

MIB = 1 << 20


def test_the_line_says_done_total_rate_and_eta() -> None:
    line = ProgressLine.format("copy", 512 * MIB, 1024 * MIB, 2.0)
    assert line == "copy: 512.0 MiB of 1.0 GiB (50%), 256.0 MiB/s, ETA 2s"
    line = ProgressLine.format("verify", 30_000, 1_230_000, 10.0)
    assert line == ("verify: 30,000 entries of 1,230,000 entries (2%), 3,000 entries/s, ETA 6m40s")
    assert ProgressLine.format("restore", 10, 10, 3700.0).endswith(", done in 1h01m")
    assert ProgressLine.format("copy", 0, 10, 0.0).endswith(", ETA unknown")


def test_a_log_gets_a_line_every_interval_and_the_end_of_a_long_phase_only() -> None:
    out, clock = io.StringIO(), ManualClock(100_000)
    progress = ProgressLine(out, clock, tty=False)
    progress("verify", 0, 100)
    progress("verify", 100, 100)  # a short phase: nothing
    assert out.getvalue() == ""
    progress("restore", 0, 100 * MIB)
    for step in range(1, 5):
        clock.advance(int(LOG_INTERVAL_S * 1000) // 2)
        progress("restore", step * 20 * MIB, 100 * MIB)
    clock.advance(1000)
    progress("restore", 100 * MIB, 100 * MIB)
    progress.finish()
    assert out.getvalue().splitlines() == [
        "restore: 40.0 MiB of 100.0 MiB (40%), 4.0 MiB/s, ETA 15s",
        "restore: 80.0 MiB of 100.0 MiB (80%), 4.0 MiB/s, ETA 5s",
        "restore: 100.0 MiB of 100.0 MiB (100%), 4.8 MiB/s, done in 21s",
    ]


def test_a_terminal_gets_one_line_rewritten_in_place_per_phase() -> None:
    out, clock = io.StringIO(), ManualClock(100_000)
    progress = ProgressLine(out, clock, tty=True)
    progress("copy", 0, 4 * MIB)
    clock.advance(1000)
    progress("copy", 2 * MIB, 4 * MIB)
    clock.advance(1000)
    progress("copy", 4 * MIB, 4 * MIB)
    progress("verify", 0, 10)
    clock.advance(1000)
    progress("verify", 10, 10)
    progress.finish()
    assert out.getvalue() == (
        "\r\x1b[Kcopy: 2.0 MiB of 4.0 MiB (50%), 2.0 MiB/s, ETA 1s"
        "\r\x1b[Kcopy: 4.0 MiB of 4.0 MiB (100%), 2.0 MiB/s, done in 2s\n"
        "\r\x1b[Kverify: 10 entries of 10 entries (100%), 10 entries/s, done in 1s\n"
    )


def test_backup_restore_and_verify_report_every_phase_to_its_end(
    source: Path, tmp_path: Path
) -> None:
    seen: list[tuple[str, int, int]] = []

    def record(phase: str, done: int, total: int) -> None:
        seen.append((phase, done, total))

    dest = tmp_path / "b"
    info = backup.backup(source, dest, record)
    entries = info.last_lsn - info.log_start_lsn + 1
    size = (dest / backup.DATA_FILE).stat().st_size
    assert seen[0][0] == "copy" and ("copy", size, size) in seen
    assert seen[-1] == ("verify", entries, entries)
    seen.clear()
    backup.restore(dest, tmp_path / "n1-restored", record)
    assert ("verify", entries, entries) in seen and seen[-1] == ("restore", size, size)
    seen.clear()
    assert backup.verify_backup(dest, record) == info
    assert seen[0] == ("verify", 0, entries) and seen[-1] == ("verify", entries, entries)


def test_store_verify_accepts_a_backup_and_refuses_a_damaged_one(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "b"
    assert run(["store", "backup", str(source), str(dest)], capsys)[0] == 0
    code, out, err = run(["store", "verify", str(dest)], capsys)
    assert (code, err) == (0, "")
    assert out.startswith(f"verified {dest}: cluster cluster-a, dirty store, epoch 2")
    # Another store under the same manifest: the read-back finds it is not the one named.
    other = tmp_path / "other"
    assert run(["store", "backup", str(source), str(other)], capsys)[0] == 0
    manifest = (other / backup.MANIFEST_FILE).read_text()
    (other / backup.MANIFEST_FILE).write_text(manifest.replace('"last_lsn": 6', '"last_lsn": 9'))
    code, out, err = run(["store", "verify", str(other), "--quiet"], capsys)
    assert code == 1 and out == "" and "not the one its manifest describes" in err
    code, _, err = run(["store", "verify", str(tmp_path)], capsys)
    assert code == 2 and "not a Squall backup" in err
