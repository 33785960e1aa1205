"""Push subscribers' rules, pure: QoS parsing, endpoints, retry counting and removal.

IceStorm's meaning (see docs/push-subscribers.md), decided here once so the servicer, the
delivery driver (``push.py``) and the tests share it. No grpc, asyncio, clock or
randomness: the driver passes the status code names it saw and the jitter it drew.

QoS keys (IceStorm's spelling, plus ``retry_count`` as another spelling):

* ``reliability``: ``"ordered"`` (one batch in flight at a time, in offset order) or
  ``""`` (none: several batches may be in flight, in any order).
* ``retryCount``: -1 retries forever; 0 removes the subscriber on the first failed
  delivery; n > 0 removes it when n deliveries in a row failed (1 is the same as 0). A
  success resets the count. This is the issue's and IceStorm's manual's meaning (IceStorm's
  code retries once more); the default is 0, as in IceStorm.
* A hard failure, the subscriber answering NOT_FOUND ("no such subscriber here",
  IceStorm's ObjectNotExistException) or UNIMPLEMENTED (no PushSubscriber service at that
  endpoint, its NotRegisteredException), removes it at once, whatever the retryCount.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from squall_server.common.config import parse_address

QOS_RELIABILITY = "reliability"
QOS_RETRY_COUNT = "retryCount"
QOS_RETRY_COUNT_ALIAS = "retry_count"
QOS_KEYS = (QOS_RELIABILITY, QOS_RETRY_COUNT, QOS_RETRY_COUNT_ALIAS)
RELIABILITY_ORDERED = "ordered"
RELIABILITIES = ("", RELIABILITY_ORDERED)
RETRY_COUNT_MAX = 1_000_000
ENDPOINT_MAX_CHARS = 255

# The subscriber's answers that mean "nothing to deliver to here, ever".
HARD_FAILURE_CODES = frozenset({"NOT_FOUND", "UNIMPLEMENTED"})

# Longest part of a caller's value quoted back in an error.
_SHOWN_CHARS_MAX = 60

Decision = Literal["retry", "remove"]
Action = Literal["continue", "backoff", "remove"]


def _show(value: str) -> str:
    if len(value) <= _SHOWN_CHARS_MAX:
        return repr(value)
    return f"{value[:_SHOWN_CHARS_MAX]!r}... ({len(value)} characters)"


@dataclass(frozen=True)
class Qos:
    """A push subscriber's quality of service."""

    ordered: bool = False
    retry_count: int = 0

    def to_map(self) -> dict[str, str]:
        """The canonical QoS map (IceStorm's keys), as GetSubscribers reports it."""
        return {
            QOS_RELIABILITY: RELIABILITY_ORDERED if self.ordered else "",
            QOS_RETRY_COUNT: str(self.retry_count),
        }


def parse_qos(qos: Mapping[str, str]) -> Qos:
    """The Qos a subscribe asked for; ValueError naming the bad key or value."""
    for key in qos:
        if key not in QOS_KEYS:
            raise ValueError(
                f"unknown QoS key {_show(key)}: the keys are {', '.join(QOS_KEYS[:2])} "
                f"(and {QOS_RETRY_COUNT_ALIAS}, another spelling of {QOS_RETRY_COUNT})"
            )
    reliability = qos.get(QOS_RELIABILITY, "")
    if reliability not in RELIABILITIES:
        raise ValueError(
            f"QoS {QOS_RELIABILITY} {_show(reliability)} is not one of "
            f"'{RELIABILITY_ORDERED}' and '' (none)"
        )
    if QOS_RETRY_COUNT in qos and QOS_RETRY_COUNT_ALIAS in qos:
        raise ValueError(
            f"QoS {QOS_RETRY_COUNT} and {QOS_RETRY_COUNT_ALIAS} are one key spelt two ways; "
            "give one of them"
        )
    key = QOS_RETRY_COUNT_ALIAS if QOS_RETRY_COUNT_ALIAS in qos else QOS_RETRY_COUNT
    text = qos.get(key, "0").strip()
    try:
        retry_count = int(text, 10)
    except ValueError:
        raise ValueError(f"QoS {key} {_show(text)} is not an integer") from None
    if not -1 <= retry_count <= RETRY_COUNT_MAX:
        raise ValueError(
            f"QoS {key} {retry_count} is outside -1..{RETRY_COUNT_MAX} (-1: retry forever)"
        )
    return Qos(ordered=reliability == RELIABILITY_ORDERED, retry_count=retry_count)


def check_endpoint(endpoint: str) -> str:
    """The endpoint if it is host:port ([v6]:port) the master can dial; else ValueError."""
    if len(endpoint) > ENDPOINT_MAX_CHARS:
        raise ValueError(
            f"malformed endpoint {_show(endpoint)}: longer than {ENDPOINT_MAX_CHARS} characters"
        )
    try:
        parse_address(endpoint)
    except ValueError as exc:
        raise ValueError(f"malformed endpoint {_show(endpoint)}: {exc}") from None
    return endpoint


def after_failure(code: str, consecutive_failures: int, retry_count: int) -> Decision:
    """Retry or remove, after a delivery failed with status `code`.

    `consecutive_failures` counts this failure (so it is at least 1).
    """
    if consecutive_failures < 1:
        raise ValueError(
            f"consecutive_failures must count this failure, got {consecutive_failures}"
        )
    if code in HARD_FAILURE_CODES:
        return "remove"
    if retry_count < 0:
        return "retry"
    # The (and IceStorm's manual's) meaning: removed after retryCount failures in
    # a row, 0 and 1 both on the first.
    return "remove" if consecutive_failures >= max(retry_count, 1) else "retry"


def backoff_ms(failures: int, initial_ms: int, max_ms: int, jitter: float) -> int:
    """How long to wait before offering events again after `failures` failures in a row.

    Doubles from initial_ms up to max_ms; the second half is jittered by `jitter` in
    [0, 1), so subscribers that failed together do not come back together.
    """
    if failures < 1 or not 0.0 <= jitter < 1.0:
        raise ValueError(f"failures {failures} must be >= 1 and jitter {jitter} in [0, 1)")
    base = min(max_ms, initial_ms * (1 << min(failures - 1, 30)))
    return base // 2 + int(jitter * (base - base // 2))


@dataclass(frozen=True)
class Offered:
    """How one Deliver call of a round ended: its events [first, end) and the status."""

    first: int
    end: int
    code: str  # "OK", or the status code name
    detail: str = ""


@dataclass(frozen=True)
class RoundResult:
    """What a round of deliveries means for the subscriber."""

    action: Action  # continue: go on; backoff: wait, then offer the failed batches again
    cursor: int  # the durable cursor the round allows (written if it grew)
    failures: int  # failed rounds in a row
    reason: str = ""  # for a removal: why, in one sentence


class DeliveryState:
    """One push subscriber's delivery on the master: what to offer and when to give up.

    A round offers up to `slots` batches at once (1 when ordered), the batches that failed
    in the last round first, in offset order, then new ones from `position`. A round in
    which any delivery failed counts as one failure; a round that all succeeded resets the
    count. The durable cursor never passes a batch not yet delivered.
    """

    def __init__(self, cursor: int, qos: Qos, inflight_batches_max: int) -> None:
        if inflight_batches_max < 1:
            raise ValueError(f"inflight_batches_max must be >= 1, got {inflight_batches_max}")
        self.qos = qos
        self.position = cursor  # the next offset never offered
        self.retry: list[tuple[int, int]] = []  # batches that failed, to offer again
        self.failures = 0
        self.last_error = ""
        self.slots = 1 if qos.ordered else inflight_batches_max

    @property
    def cursor(self) -> int:
        """The next offset not known to be delivered."""
        return self.retry[0][0] if self.retry else self.position

    def retry_batches(self) -> list[tuple[int, int]]:
        """The failed batches to offer first in the next round."""
        return self.retry[: self.slots]

    def new_batches(self) -> int:
        """How many new batches the next round may offer after the retried ones."""
        return max(0, self.slots - len(self.retry))

    def finish_round(self, offered: Iterable[Offered]) -> RoundResult:
        """Takes a round's outcomes; says whether to go on, back off or remove."""
        outcomes = list(offered)
        if not outcomes:
            raise ValueError("a round offers at least one batch")
        self.position = max(self.position, max(o.end for o in outcomes))
        failed = sorted((o for o in outcomes if o.code != "OK"), key=lambda o: o.first)
        self.retry = sorted(
            {(o.first, o.end) for o in failed}
            | set(self.retry) - {(o.first, o.end) for o in outcomes}
        )
        if not failed:
            self.failures = 0
            self.last_error = ""
            return RoundResult("continue", self.cursor, 0)
        self.failures += 1
        worst = next((o for o in failed if o.code in HARD_FAILURE_CODES), failed[0])
        self.last_error = f"{worst.code}: {worst.detail}" if worst.detail else worst.code
        decision = after_failure(worst.code, self.failures, self.qos.retry_count)
        if decision == "retry":
            return RoundResult("backoff", self.cursor, self.failures)
        if worst.code in HARD_FAILURE_CODES:
            reason = (
                f"the subscriber answered {worst.code} (no such subscriber there): "
                f"{worst.detail or '-'}"
            )
        else:
            reason = (
                f"{self.failures} failed deliveries in a row with retryCount "
                f"{self.qos.retry_count}; the last: {self.last_error}"
            )
        return RoundResult("remove", self.cursor, self.failures, reason)
