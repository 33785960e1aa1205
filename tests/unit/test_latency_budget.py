"""The latency budget's delivery stages join a publish's commit to its delivery only for
the delivery scenarios' topics (bench/latency.py, ``delivery_budget``)."""

from __future__ import annotations

from pathlib import Path

from bench import latency

MASTER_PID, CLIENT_PID = 100, 200
ROLES = {MASTER_PID: "replica-n1", CLIENT_PID: "client"}


def _write_marks(directory: Path, pid: int, lines: list[str]) -> None:
    with (directory / f"{pid}.stages").open("a", encoding="ascii") as out:
        out.write("".join(f"{line}\n" for line in lines))


def _published(key: str, lsn: int, topic: str, committed_ns: int, sent_ns: int) -> list[str]:
    """The master's marks of one publish committed and then sent to a subscriber."""
    return [
        f"= {key} lsn/{lsn}",
        f"= {key} off/{topic}/0",
        f"m.commit lsn/{lsn} {committed_ns}",
        f"d.out off/{topic}/0 {sent_ns}",
    ]


def test_a_topic_read_back_long_after_its_publish_is_not_a_delivery(tmp_path: Path) -> None:
    # The suite's pipelined topics are committed first and read back by its consume phase
    # a minute later; the delivery scenario's event is sent 200 µs after its commit.
    minute_ns = 60_000_000_000
    lines: list[str] = []
    for index in range(5):
        lines += _published(f"p{index}/1", 10 + index, f"bench-pipelined-{index}", 0, minute_ns)
    lines += _published("d/1", 50, "latency-delivery", minute_ns, minute_ns + 200_000)
    _write_marks(tmp_path, MASTER_PID, lines)

    budget = latency.delivery_budget(
        tmp_path, ROLES, "replica-n1", ("latency-delivery", "latency-push")
    )

    assert budget["events"] == 1
    assert budget["commit_to_sent_us_p50"] == 200.0
