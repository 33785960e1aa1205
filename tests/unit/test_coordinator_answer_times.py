"""How long the replica's recent answers took (``coordinator/answer_times.py``): the
longest round trip of about the last two seconds, which the election allows a silence
after them in proportion to (docs/operations.md, "One fate per node")."""

from __future__ import annotations

from squall_server.coordinator.answer_times import ANSWER_TIMES_BUCKET_MS, RecentAnswerTimes


def test_a_slow_answer_is_remembered_for_one_to_two_seconds_then_forgotten() -> None:
    times, bucket = RecentAnswerTimes(), ANSWER_TIMES_BUCKET_MS
    assert times.longest_ms(0) == 0
    times.record(5, 10)
    times.record(120, 400)
    times.record(8, 900)
    assert times.longest_ms(900) == 120
    times.record(3, bucket + 50)  # the next bucket: still recent
    assert times.longest_ms(bucket + 60) == 120
    times.record(4, 2 * bucket + 100)  # two buckets on: forgotten
    assert times.longest_ms(2 * bucket + 100) == 4


def test_nothing_recorded_for_two_seconds_leaves_nothing_to_remember() -> None:
    times, bucket = RecentAnswerTimes(), ANSWER_TIMES_BUCKET_MS
    times.record(250, 100)
    assert times.longest_ms(bucket + 200) == 250
    assert times.longest_ms(5 * bucket) == 0
