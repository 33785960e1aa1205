"""The bare relay chain behind the latency report's bounds (bench/chain_floor.py): it must
carry what it says, in the shape it says, or every verdict read against it is wrong.

No figure is judged (speed belongs in bench/); what is checked is the chain's shape: the
master relay answers once one slave has acked (a majority of three) and not before, the
joined load answers every caller, and every relay is gone after the run.
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from bench import chain_floor

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_master_relay_answers_once_one_slave_has_acked_and_not_before() -> None:
    with chain_floor.running("proxy") as (address, pids):
        assert set(pids) == {"slave-1", "slave-2", "master"}
        assert chain_floor.one_at_a_time(address, 20, 10.0)["events"] == 20
        stopped = []
        try:
            os.kill(pids["slave-1"], signal.SIGSTOP)
            stopped.append(pids["slave-1"])
            # The other slave's ack is a majority of three with the master.
            assert chain_floor.one_at_a_time(address, 20, 10.0)["events"] == 20
            os.kill(pids["slave-2"], signal.SIGSTOP)
            stopped.append(pids["slave-2"])
            with pytest.raises(grpc.RpcError) as failed:
                chain_floor.one_at_a_time(address, 5, 1.0)
            assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    assert all(_gone(pid) for pid in pids.values())


def test_joined_callers_through_the_gateway_chain_are_each_answered() -> None:
    with chain_floor.running("gateway") as (address, pids):
        assert set(pids) == {"slave-1", "slave-2", "master", "gateway"}
        figures = chain_floor.joined(address, 8, 1.0, pids)
    assert figures["events"] > 8
    assert figures["callers"] == 8
    assert set(figures["cpu_us_per_event"]) == {"client", *pids}
    assert all(_gone(pid) for pid in pids.values())
