"""The master's reconnection backoff to a slave (``master_streams.ReconnectBackoff``),
which ``MasterDriver`` sleeps and the replication simulator schedules."""

from __future__ import annotations

from squall_server.replica.master_streams import (
    RECONNECT_BACKOFF_MAX_MS,
    RECONNECT_BACKOFF_MIN_MS,
    ReconnectBackoff,
)


def test_unopened_streams_double_the_wait_up_to_the_bound_and_an_opened_one_resets_it() -> None:
    backoff = ReconnectBackoff()
    waits = [backoff.after(opened=False) for _ in range(8)]
    assert waits == [50, 100, 200, 400, 800, 1000, 1000, 1000]
    assert (RECONNECT_BACKOFF_MIN_MS, RECONNECT_BACKOFF_MAX_MS) == (50, 1000)
    # The last stream opened: the slave is back, so the next try is quick.
    assert backoff.after(opened=True) == 50
    assert backoff.after(opened=False) == 100
    assert backoff.after(opened=True) == 50


def test_each_slave_backs_off_on_its_own() -> None:
    down, up = ReconnectBackoff(), ReconnectBackoff()
    for _ in range(3):
        down.after(opened=False)
    assert up.after(opened=True) == 50
    assert down.after(opened=False) == 400
