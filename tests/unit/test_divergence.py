"""Tests of squall_server.replica.divergence: where two logs part, by their epoch histories.

Besides hand-written cases (Raft's figure-7 shapes), two seeded property tests: logs that
share a prefix and then diverge, and a small cluster whose masters append and whose
replicas copy prefixes of the master's log epoch after epoch. In both, ``fork_lsn`` must
equal the true common prefix, computed from the entries themselves. A failure names the
seed that replays it.
"""

from __future__ import annotations

import random

import pytest

from squall.v1 import replica_pb2
from squall_server.replica.divergence import (
    HistoryError,
    as_history,
    check_history,
    epoch_at,
    fork_lsn,
    history_problem,
    truncate_history,
)
from squall_server.replica.store import EpochBoundary

SEEDS = range(300)


def history_of(epochs: list[int]) -> list[tuple[int, int]]:
    """The epoch history of a log given as the epoch of each entry (LSN 1 first)."""
    out: list[tuple[int, int]] = []
    for i, epoch in enumerate(epochs):
        if not out or out[-1][0] != epoch:
            out.append((epoch, i + 1))
    return out


def common_prefix(a: list[object], b: list[object]) -> int:
    """How many leading entries two logs share (the oracle)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def fork_of(a: list[int], b: list[int]) -> int:
    """fork_lsn for two logs given as per-entry epochs."""
    return fork_lsn(history_of(a), len(a), history_of(b), len(b))


# --- hand-written cases


def test_empty_logs_part_at_zero() -> None:
    assert fork_lsn([], 0, [], 0) == 0
    assert fork_of([1, 1, 2], []) == 0
    assert fork_of([], [1, 1]) == 0


def test_identical_logs_agree_to_the_end() -> None:
    log = [1, 1, 1, 3, 3, 4]
    assert fork_of(log, log) == 6


def test_a_shorter_log_agrees_up_to_its_end() -> None:
    assert fork_of([1, 1, 2, 2, 2], [1, 1, 2]) == 3
    assert fork_of([1, 1, 2], [1, 1, 2, 2, 2]) == 3


def test_logs_part_where_their_epochs_differ() -> None:
    # The slave kept epoch-2 entries a deposed master wrote at LSNs 4..6; the master's
    # log has epoch 3 from LSN 4.
    assert fork_of([1, 1, 1, 3, 3], [1, 1, 1, 2, 2, 2]) == 3
    # Epoch 2 wrote LSNs 4..5 on both, then the slave got more epoch-2 entries while the
    # master of epoch 4 had moved on from LSN 6.
    assert fork_of([1, 1, 1, 2, 2, 4, 4], [1, 1, 1, 2, 2, 2, 2, 2]) == 5


def test_an_epoch_only_one_log_has_parts_them_at_its_start() -> None:
    # The master holds more of epoch 1 where the slave has a deposed epoch 2.
    assert fork_of([1, 1, 1, 1, 1, 3], [1, 1, 2, 2, 2, 2, 2]) == 2


def test_raft_figure_7_followers() -> None:
    # The leader's log of Raft's figure 7 (terms per index) and followers (a)..(f).
    leader = [1, 1, 1, 4, 4, 5, 5, 6, 6, 6]
    cases = {
        "a": ([1, 1, 1, 4, 4, 5, 5, 6, 6], 9),
        "b": ([1, 1, 1, 4], 4),
        "c": ([1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 6], 10),
        "d": ([1, 1, 1, 4, 4, 5, 5, 6, 6, 6, 7, 7], 10),
        "e": ([1, 1, 1, 4, 4, 4, 4], 5),
        "f": ([1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3], 3),
    }
    for name, (follower, expected) in cases.items():
        assert fork_of(leader, follower) == expected, name
        assert fork_of(follower, leader) == expected, name


def test_histories_from_the_store_and_the_wire_are_accepted() -> None:
    store_history = (EpochBoundary(1, 1), EpochBoundary(3, 4))
    wire_history = [
        replica_pb2.EpochBoundary(epoch=1, start_lsn=1),
        replica_pb2.EpochBoundary(epoch=2, start_lsn=4),
    ]
    assert as_history(store_history) == ((1, 1), (3, 4))
    assert fork_lsn(store_history, 5, wire_history, 6) == 3


def test_epoch_at_and_truncate_history() -> None:
    history = check_history([(1, 1), (3, 4), (7, 9)], 12)
    assert [epoch_at(history, lsn) for lsn in range(13)] == [0, 1, 1, 1, 3, 3, 3, 3, 3, 7, 7, 7, 7]
    assert truncate_history(history, 12) == history
    assert truncate_history(history, 9) == history
    assert truncate_history(history, 8) == ((1, 1), (3, 4))
    assert truncate_history(history, 3) == ((1, 1),)
    assert truncate_history(history, 0) == ()


@pytest.mark.parametrize(
    ("history", "last_lsn", "problem"),
    [
        ([(1, 1)], 0, "an empty log with 1 epoch boundaries"),
        ([], 3, "no epoch history"),
        ([(1, 2)], 3, "starts at LSN 2, not 1"),
        ([(2, 1), (2, 3)], 3, "epochs must increase"),
        ([(2, 1), (1, 3)], 3, "epochs must increase"),
        ([(1, 1), (2, 1)], 3, "not after epoch 1's start 1"),
        ([(1, 1), (2, 5)], 3, "beyond the last LSN 3"),
        ([(0, 1)], 3, "not a positive uint64"),
        ([(1, 1)], -1, "not a uint64"),
    ],
)
def test_impossible_histories_are_refused_with_the_reason(
    history: list[tuple[int, int]], last_lsn: int, problem: str
) -> None:
    found = history_problem(as_history(history), last_lsn)
    assert found is not None and problem in found
    with pytest.raises(HistoryError, match=problem):
        fork_lsn([(1, 1)], 5, history, last_lsn)
    with pytest.raises(HistoryError, match=problem):
        fork_lsn(history, last_lsn, [(1, 1)], 5)


# --- property tests


def _diverging_pair(rng: random.Random) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Two logs of (epoch, entry id) sharing a random prefix, then written by different
    masters (disjoint epochs), the prefix's last epoch continuing in at most one of them."""
    prefix: list[tuple[int, int]] = []
    epoch = 0
    uid = 0
    for _ in range(rng.randrange(0, 4)):
        epoch += rng.randrange(1, 3)
        for _ in range(rng.randrange(1, 5)):
            uid += 1
            prefix.append((epoch, uid))
    next_epoch = epoch + 1
    suffixes: list[list[tuple[int, int]]] = [[], []]
    # The epochs after the prefix go, one by one, to one side or the other.
    continue_side = rng.randrange(3)  # 2: neither side continues the prefix's epoch
    if prefix and continue_side < 2:
        for _ in range(rng.randrange(1, 4)):
            uid += 1
            suffixes[continue_side].append((epoch, uid))
    for _ in range(rng.randrange(0, 5)):
        side = rng.randrange(2)
        for _ in range(rng.randrange(1, 4)):
            uid += 1
            suffixes[side].append((next_epoch, uid))
        next_epoch += rng.randrange(1, 3)
    return prefix + suffixes[0], prefix + suffixes[1]


@pytest.mark.parametrize("seed", SEEDS)
def test_fork_is_the_true_common_prefix_of_diverging_logs(seed: int) -> None:
    rng = random.Random(seed)
    a, b = _diverging_pair(rng)
    expected = common_prefix(list(a), list(b))
    ea, eb = [e for e, _ in a], [e for e, _ in b]
    assert fork_of(ea, eb) == expected, f"reproduce with seed={seed}: {a} vs {b}"
    assert fork_of(eb, ea) == expected, f"reproduce with seed={seed} (swapped)"


def _history_of_log(log: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return history_of([epoch for epoch, _, _ in log])


@pytest.mark.parametrize("seed", SEEDS)
def test_fork_matches_entries_in_a_simulated_cluster(seed: int) -> None:
    """Masters append their epoch's entries; replicas truncate to where they agree with the
    master and copy a random prefix of its log. Every pair's fork is their true common
    prefix, compared entry by entry (entries carry unique ids)."""
    rng = random.Random(seed)
    nodes = rng.randrange(2, 6)
    logs: list[list[tuple[int, int, int]]] = [[] for _ in range(nodes)]
    uid = 0
    for epoch in range(1, rng.randrange(2, 12)):
        master = rng.randrange(nodes)
        for _ in range(rng.randrange(1, 4)):
            for _ in range(rng.randrange(1, 5)):
                uid += 1
                log = logs[master]
                log.append((epoch, len(log) + 1, uid))
            for node in range(nodes):
                if node == master or rng.random() < 0.4:
                    continue
                fork = common_prefix(list(logs[node]), list(logs[master]))
                found = fork_lsn(
                    _history_of_log(logs[master]),
                    len(logs[master]),
                    _history_of_log(logs[node]),
                    len(logs[node]),
                )
                assert found == fork, f"reproduce with seed={seed}: node {node} epoch {epoch}"
                upto = rng.randrange(fork, len(logs[master]) + 1)
                logs[node] = logs[node][:fork] + logs[master][fork:upto]
    for i in range(nodes):
        for j in range(nodes):
            expected = common_prefix(list(logs[i]), list(logs[j]))
            found = fork_lsn(
                _history_of_log(logs[i]), len(logs[i]), _history_of_log(logs[j]), len(logs[j])
            )
            assert found == expected, f"reproduce with seed={seed}: nodes {i} and {j}"
