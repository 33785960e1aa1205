"""The shared retry classifier (`squall.wire.retry`): a table of status code x sent -> outcome.

Goal: the one rule the client library and the gateway both apply says "indeterminate" for
exactly the codes that leave a sent request's fate unknown, "definite" for everything else
(and for anything never sent), and retries only indeterminate, deduplicated requests.
"""

from __future__ import annotations

import ast
import inspect

import grpc
import pytest

import squall
from squall.wire import retry as _retry

INDETERMINATE = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED", "INTERNAL"}

# Every gRPC status code, sent and not sent.
TABLE = [
    (
        code.name,
        sent,
        "ok"
        if code.name == "OK"
        else "indeterminate"
        if sent and code.name in INDETERMINATE
        else "definite",
    )
    for code in grpc.StatusCode
    for sent in (True, False)
]


@pytest.mark.parametrize(("code", "sent", "outcome"), TABLE)
def test_classify_table(code: str, sent: bool, outcome: str) -> None:
    assert squall.classify_code(code, sent) == outcome
    # The library's grpc-typed wrapper says the same.
    assert squall.classify(grpc.StatusCode[code], sent) == outcome


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        ("UNAVAILABLE", "indeterminate"),
        ("UNKNOWN", "indeterminate"),  # the replica's "indeterminate"
        ("DEADLINE_EXCEEDED", "indeterminate"),
        ("FAILED_PRECONDITION", "definite"),  # no quorum, stale epoch: not applied
        ("ABORTED", "definite"),  # "not applied, ask the master"
        ("INVALID_ARGUMENT", "definite"),
        ("NOT_FOUND", "definite"),
        ("ALREADY_EXISTS", "definite"),
        ("RESOURCE_EXHAUSTED", "definite"),
    ],
)
def test_replica_answers_after_send(code: str, outcome: str) -> None:
    assert squall.classify_code(code, sent=True) == outcome


def test_indeterminate_codes_are_the_documented_ones() -> None:
    assert squall.INDETERMINATE_AFTER_SEND == INDETERMINATE


def test_only_grpc_aios_stand_in_for_a_lost_stream_status_counts_as_lost() -> None:
    # grpc/grpc#36066: what grpc.aio reports when a write races the stream's end.
    assert _retry.status_lost("INTERNAL", "Internal error from Core")
    assert not _retry.status_lost("INTERNAL", "Received RST_STREAM with error code 2")
    assert not _retry.status_lost("UNAVAILABLE", "Internal error from Core")


@pytest.mark.parametrize(
    ("outcome", "deduplicated", "retry"),
    [
        ("indeterminate", True, True),
        ("indeterminate", False, False),  # no publisher id / sequence: never repeated
        ("definite", True, False),
        ("definite", False, False),
        ("ok", True, False),
    ],
)
def test_only_indeterminate_deduplicated_attempts_are_retried(
    outcome: squall.Outcome, deduplicated: bool, retry: bool
) -> None:
    assert squall.retryable(outcome, deduplicated=deduplicated) is retry


@pytest.mark.parametrize(
    ("outcomes", "result"),
    [
        (["ok"], "ok"),
        (["definite"], "definite"),
        (["indeterminate"], "indeterminate"),
        (["indeterminate", "indeterminate", "ok"], "ok"),
        (["indeterminate", "definite"], "indeterminate"),
        (["definite", "definite"], "definite"),
        (["definite", "indeterminate"], "indeterminate"),
    ],
)
def test_overall_outcome_of_a_retried_call(
    outcomes: list[squall.Outcome], result: squall.Outcome
) -> None:
    assert squall.overall(outcomes) == result


def test_overall_needs_an_attempt() -> None:
    with pytest.raises(ValueError, match="at least one attempt"):
        squall.overall([])


def test_policy_defaults_and_backoff_ceilings() -> None:
    policy = squall.RetryPolicy()
    policy.validate()
    assert (policy.attempts_max, policy.backoff_initial_ms) == (0, 50)
    assert (policy.backoff_max_ms, policy.total_ms_max) == (250, 10_000)
    assert [policy.backoff_ceiling_ms(n) for n in range(1, 8)] == [
        50,
        100,
        200,
        250,
        250,
        250,
        250,
    ]
    assert policy.backoff_ceiling_ms(10_000) == 250
    assert policy.retries
    assert not squall.RetryPolicy(attempts_max=1).retries
    assert squall.RetryPolicy(attempts_max=0).retries


def test_the_retry_budget_is_time_and_the_attempt_cap_is_optional() -> None:
    policy = squall.RetryPolicy()  # no attempt cap, 10 s
    # Far more attempts than the old cap of 16 while time is left ...
    assert not policy.exhausted(attempts=1_000, elapsed_ms=9_999)
    # ... and none once the budget is spent, however few were made.
    assert policy.exhausted(attempts=1, elapsed_ms=10_000)
    capped = squall.RetryPolicy(attempts_max=3, total_ms_max=60_000)
    assert not capped.exhausted(attempts=2, elapsed_ms=0)
    assert capped.exhausted(attempts=3, elapsed_ms=0)
    assert squall.RetryPolicy(attempts_max=1).exhausted(attempts=1, elapsed_ms=0)
    with pytest.raises(ValueError, match="starts at 1"):
        policy.backoff_ceiling_ms(0)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            squall.RetryPolicy(attempts_max=-1),
            "retry_attempts_max must be from 0 to 100000, got -1",
        ),
        (
            squall.RetryPolicy(attempts_max=True),
            "retry_attempts_max must be an integer, got True",
        ),
        (
            squall.RetryPolicy(backoff_max_ms=700_000),
            "retry_backoff_max_ms must be from 1 to 600000, got 700000",
        ),
        (
            squall.RetryPolicy(backoff_initial_ms=100, backoff_max_ms=10),
            "retry_backoff_initial_ms must not exceed retry_backoff_max_ms (10), got 100",
        ),
    ],
)
def test_policy_validation(policy: squall.RetryPolicy, message: str) -> None:
    with pytest.raises(ValueError) as err:
        policy.validate()
    assert str(err.value) == message


def test_classifier_module_is_pure() -> None:
    # STYLE.md point 1: no grpc, clock, randomness, threads or event loop in the core.
    tree = ast.parse(inspect.getsource(_retry))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "collections", "dataclasses", "typing"}
