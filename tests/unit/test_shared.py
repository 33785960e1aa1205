"""The shared-subscription core (services/replica/shared.py), deterministically.

Goal: each event goes to one consumer at a time; an ack is per message and out of order;
a lapsed ack deadline or a nack redelivers (after the nack's delay) to any consumer; an
event that failed `max_deliveries` times is dead-lettered with its count and last error,
never offered again; a consumer's outstanding limit holds; an ack or nack of a message the
consumer does not hold is refused and changes nothing; exclusive mode delivers in order to
one consumer and hands over when it goes quiet; a new master built from the replicated
state redelivers exactly what was not acknowledged.
"""

from __future__ import annotations

import pytest

from squall_server.common.errors import Code, ServiceError
from squall_server.replica.shared import DEADLINE_ERROR, SharedConfig, SharedSubscription

CONFIG = SharedConfig(ack_deadline_ms=1_000, max_deliveries=3, outstanding_max=4)
E = 7  # the master's epoch


def _offsets(deliveries: list[object]) -> list[int]:
    return [d.offset for d in deliveries]  # type: ignore[attr-defined]


def _refused(call: object, code: Code) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code == code
    return caught.value


def test_each_event_goes_to_one_consumer_and_acks_are_per_message() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=6)
    a = sub.pull("a", 3, now_ms=0)
    b = sub.pull("b", 10, now_ms=0)
    assert _offsets(a) == [0, 1, 2] and _offsets(b) == [3, 4, 5]
    assert all(d.attempt == 1 and d.deadline_ms == 1_000 for d in a + b)
    assert sub.pull("c", 5, now_ms=0) == []  # nothing left, nothing offered twice
    # Out of order: the floor (the cursor) moves only over a prefix of done offsets.
    assert sub.ack("b", [4], E).acked == [4] and sub.floor == 0
    assert sub.ack("a", [0, 1], E).acked == [0, 1] and sub.floor == 2
    assert sub.ack("a", [1], E).acked == []  # a retried ack: ok, nothing to log again
    sub.committed(8)
    assert _offsets(sub.pull("c", 5, now_ms=0)) == [6, 7]


def test_a_lapsed_deadline_redelivers_to_any_consumer_and_the_late_ack_is_refused() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=2)
    sub.pull("a", 2, now_ms=0)
    assert sub.next_deadline_ms() == 1_000
    assert sub.tick(999).failed == []
    lapsed = sub.tick(1_000)
    assert [o for o, _ in lapsed.failed] == [0, 1]
    assert all(DEADLINE_ERROR in error and "consumer a" in error for _, error in lapsed.failed)
    again = sub.pull("b", 5, now_ms=1_000)
    assert _offsets(again) == [0, 1] and [d.attempt for d in again] == [2, 2]
    refused = _refused(lambda: sub.ack("a", [0, 1], E), Code.FAILED_PRECONDITION)
    assert "consumer 'b' does" in refused.message
    assert sub.outstanding("b") == 2 and sub.floor == 0  # nothing changed
    assert sub.ack("b", [0, 1], E).acked == [0, 1] and sub.floor == 2


def test_nack_redelivers_after_its_delay_and_max_deliveries_dead_letters() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=2)
    sub.pull("a", 2, now_ms=0)
    sub.ack("a", [1], E)
    first = sub.nack("a", [0], E, delay_ms=500, error="bad payload", now_ms=10)
    assert first.failed == [(0, "bad payload")] and first.dead_letters == []
    assert sub.pull("a", 5, now_ms=509) == []  # not before its delay
    assert [d.attempt for d in sub.pull("b", 5, now_ms=510)] == [2]
    sub.nack("b", [0], E, delay_ms=0, error="still bad", now_ms=600)
    (third,) = sub.pull("c", 5, now_ms=600)
    assert third.attempt == 3
    last = sub.nack("c", [0], E, delay_ms=0, error="poison", now_ms=700)
    (dead,) = last.dead_letters
    assert (dead.offset, dead.deliveries, dead.last_error) == (0, 3, "poison")
    assert sub.floor == 2 and sub.dead_lettered == 1
    assert sub.pull("d", 5, now_ms=10_000) == []  # never offered again


def test_the_outstanding_limit_is_per_consumer() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=20)
    assert len(sub.pull("a", 10, now_ms=0)) == 4
    assert sub.pull("a", 10, now_ms=0) == []
    assert len(sub.pull("b", 2, now_ms=0)) == 2
    sub.ack("a", [0], E)
    assert _offsets(sub.pull("a", 10, now_ms=0)) == [6]


def test_bad_acks_and_nacks_change_nothing() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=5)
    sub.pull("a", 2, now_ms=0)
    never = _refused(lambda: sub.ack("a", [3], E), Code.INVALID_ARGUMENT)
    assert "never delivered" in never.message
    _refused(lambda: sub.ack("a", [9], E), Code.INVALID_ARGUMENT)
    # One bad offset refuses the whole call: offset 0 stays unacknowledged.
    _refused(lambda: sub.ack("a", [0, 3], E), Code.INVALID_ARGUMENT)
    _refused(
        lambda: sub.nack("b", [0], E, delay_ms=0, error="x", now_ms=1), Code.FAILED_PRECONDITION
    )
    _refused(lambda: sub.nack("a", [0], E, delay_ms=-1, error="x", now_ms=1), Code.INVALID_ARGUMENT)
    assert sub.floor == 0 and sub.outstanding("a") == 2
    sub.ack("a", [0], E)
    _refused(
        lambda: sub.nack("a", [0], E, delay_ms=0, error="x", now_ms=1), Code.FAILED_PRECONDITION
    )
    for bad in (
        SharedConfig(ack_deadline_ms=1, max_deliveries=0),
        SharedConfig(ack_deadline_ms=0, max_deliveries=1),
    ):
        _refused(
            lambda bad=bad: SharedSubscription(bad, epoch=E, floor=0, committed_end=0),
            Code.INVALID_ARGUMENT,
        )  # type: ignore[misc]


def test_a_new_master_redelivers_exactly_what_was_not_acknowledged() -> None:
    # The replicated state of the old master: floor 2, offset 3 acked, offset 2 failed once.
    sub = SharedSubscription(
        CONFIG,
        epoch=E,
        floor=2,
        committed_end=6,
        acked=[3],
        failures={2: 1},
        last_errors={2: "timeout"},
    )
    got = sub.pull("a", 2, now_ms=0)
    assert _offsets(got) == [2, 4]
    assert [d.attempt for d in got] == [2, 1] and {d.epoch for d in got} == {E}
    # An ack from a consumer of the old master counts unless the offset is leased now.
    assert sub.ack("old-consumer", [5], E - 1).acked == [5]
    _refused(lambda: sub.ack("old-consumer", [4], E - 1), Code.FAILED_PRECONDITION)
    # In this master's own epoch it knows what it handed out.
    sub.committed(7)
    _refused(lambda: sub.ack("a", [6], E), Code.INVALID_ARGUMENT)
    _refused(lambda: sub.ack("a", [7], E - 1), Code.INVALID_ARGUMENT)  # never committed


def test_exclusive_mode_delivers_in_order_to_one_consumer_and_hands_over() -> None:
    config = SharedConfig(
        ack_deadline_ms=1_000, max_deliveries=5, exclusive=True, exclusive_takeover_ms=3_000
    )
    sub = SharedSubscription(config, epoch=E, floor=0, committed_end=4)
    assert _offsets(sub.pull("a", 2, now_ms=0)) == [0, 1] and sub.holder == "a"
    assert sub.pull("b", 2, now_ms=0) == []
    sub.nack("a", [0], E, delay_ms=2_000, error="later", now_ms=100)
    sub.ack("a", [1], E)
    # Offset 0 waits for its delay and holds back everything after it: order first.
    assert sub.pull("a", 5, now_ms=1_000) == []
    assert _offsets(sub.pull("a", 5, now_ms=2_100)) == [0, 2, 3]
    sub.ack("a", [0, 2, 3], E)
    # "a" goes quiet: after the takeover time "b" holds the subscription.
    sub.committed(6)
    sub.tick(5_099)
    assert sub.holder == "a" and sub.pull("b", 5, now_ms=5_099) == []
    sub.tick(5_100)
    assert sub.holder is None
    assert _offsets(sub.pull("b", 5, now_ms=5_100)) == [4, 5] and sub.holder == "b"


def test_a_seek_drops_leases_and_counts() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=6)
    sub.pull("a", 3, now_ms=0)
    sub.nack("a", [0], E, delay_ms=0, error="x", now_ms=0)
    sub.seek(1)
    assert sub.floor == 1 and sub.outstanding() == 0
    got = sub.pull("b", 10, now_ms=0)
    assert _offsets(got) == [1, 2, 3, 4] and {d.attempt for d in got} == {1}


def test_a_late_ack_of_an_event_another_consumer_acked_is_refused() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=1)
    sub.pull("a", 1, now_ms=0)
    sub.tick(1_000)  # a's lease lapsed
    assert _offsets(sub.pull("b", 1, now_ms=1_000)) == [0]
    assert sub.ack("b", [0], E).acked == [0] and sub.floor == 1
    refused = _refused(lambda: sub.ack("a", [0], E), Code.FAILED_PRECONDITION)
    assert "consumer 'b' acknowledged it" in refused.message
    assert sub.ack("b", [0], E).acked == []  # b's own retry: ok


def test_failures_from_an_earlier_master_do_not_skip_offsets_never_delivered() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=4, failures={2: 1})
    assert sorted(_offsets(sub.pull("a", 4, now_ms=0))) == [0, 1, 2, 3]


def test_released_leases_are_due_again_without_counting_a_failure() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=3)
    assert _offsets(sub.pull("a", 3, now_ms=0)) == [0, 1, 2]
    sub.release("a", [1, 2])  # the answer's byte limit kept them from the consumer
    assert sub.outstanding("a") == 1
    again = sub.pull("b", 3, now_ms=0)
    assert _offsets(again) == [1, 2] and [d.attempt for d in again] == [1, 1]


def test_a_held_lease_can_be_extended_and_only_by_its_holder() -> None:
    sub = SharedSubscription(CONFIG, epoch=E, floor=0, committed_end=2)
    sub.pull("a", 1, now_ms=0)
    assert sub.extend("a", [0], E, extension_ms=5_000, now_ms=900) == 5_900
    assert sub.tick(1_000).failed == []  # the old deadline no longer applies
    _refused(lambda: sub.extend("b", [0], E, extension_ms=10, now_ms=900), Code.FAILED_PRECONDITION)
    _refused(lambda: sub.extend("a", [1], E, extension_ms=10, now_ms=900), Code.INVALID_ARGUMENT)
    assert [o for o, _ in sub.tick(5_900).failed] == [0]
    refused = _refused(
        lambda: sub.extend("a", [0], E, extension_ms=10, now_ms=6_000), Code.FAILED_PRECONDITION
    )
    assert "does not hold it" in refused.message
