"""The retry policy's pure core: what a failed attempt means, and how far retrying may go.

Shared by the client library and the gateway (both import this module), so both decide
the same way. It works on status code *names* ("UNAVAILABLE") and plain numbers, and
imports nothing but the standard library's typing helpers: no grpc, clock, randomness or
threads (STYLE.md point 1). The drivers that sleep and call (tenacity in
`squall._publish_rules` and `squall_server.gateway.forward`) live elsewhere.

Three outcomes, kept apart (STYLE.md point 6):

* ``ok`` — the call happened;
* ``definite`` — it did not happen, and trying the same request again gives the same
  answer (a bad request, a missing topic) or needs the app to decide;
* ``indeterminate`` — it may or may not have happened: the request may have reached a
  server and the answer was lost. Only this is retried, and only when the master
  deduplicates the request, i.e. a publish whose events all carry a sequence under a
  publisher id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["ok", "definite", "indeterminate"]

# Codes that, once a request has left the caller, do not say whether it was applied: the
# connection broke, the deadline passed, or the server failed somewhere unknown (the
# replica answers UNKNOWN for "indeterminate"). CANCELLED and INTERNAL are here because
# gRPC reports a reset or torn-down stream with them after the request was on the wire.
# ABORTED is not: Squall's services use it for "not applied, ask the master" answers.
INDETERMINATE_AFTER_SEND: frozenset[str] = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED", "INTERNAL"}
)


# What grpc.aio reports (INTERNAL, with these details) instead of the status a server
# ended a stream with, when a request was being written at that moment (grpc/grpc#36066):
# the real status, its trailing metadata with it (a slave's redirect), is lost. The
# server ended the stream, so it is up; the outcome of what was unanswered is unknown.
_CORE_WRITE_ERROR = "Internal error from Core"


def status_lost(code: str, details: str) -> bool:
    """True when a stream's status (code name, details) is grpc.aio's stand-in for one
    it lost (see above), not the server's own."""
    return code == "INTERNAL" and details == _CORE_WRITE_ERROR


def classify(code: str, sent: bool) -> Outcome:
    """Says whether one attempt ended in success, a definite failure, or an unknown outcome.

    `code` is a gRPC status code name ("OK", "UNAVAILABLE", ...); `sent` is whether the
    request may have reached a server. A request that never left the caller failed
    definitely, whatever the code.
    """
    if code == "OK":
        return "ok"
    if sent and code in INDETERMINATE_AFTER_SEND:
        return "indeterminate"
    return "definite"


def retryable(outcome: Outcome, *, deduplicated: bool) -> bool:
    """True if an attempt with this outcome may be repeated with the same request.

    Only an indeterminate outcome is retried, and only when a repeat cannot apply the
    request twice (`deduplicated`: the master recognises it, or it has no effect).
    """
    return outcome == "indeterminate" and deduplicated


def overall(outcomes: Iterable[Outcome]) -> Outcome:
    """The outcome of a call made of attempts of the same request, oldest first.

    The last attempt's success settles it (the master deduplicated any earlier copy).
    Otherwise, if any attempt may have been applied, so may the call: a definite failure
    on a retry does not undo what an earlier, indeterminate attempt may have stored.
    """
    seen = list(outcomes)
    if not seen:
        raise ValueError("a call has at least one attempt")
    if seen[-1] == "ok":
        return "ok"
    return "indeterminate" if "indeterminate" in seen else "definite"


# Inclusive bounds of each policy field, shared with the configuration file's [retry]
# section (whose keys are these names with a "retry_" prefix).
POLICY_BOUNDS: Mapping[str, tuple[int, int]] = {
    "attempts_max": (0, 100_000),
    "backoff_initial_ms": (1, 60_000),
    "backoff_max_ms": (1, 600_000),
    "total_ms_max": (1, 3_600_000),
}

# 0: no cap on the number of attempts; the time budget (total_ms_max) alone bounds
# retrying. A count is a poor budget: with the backoff capped at 250 ms, 16 attempts used
# to run out in about 2 s, shorter than a failover or a gateway restart on a loaded machine.
RETRY_ATTEMPTS_MAX_DEFAULT = 0
RETRY_BACKOFF_INITIAL_MS_DEFAULT = 50
RETRY_BACKOFF_MAX_MS_DEFAULT = 250
# Long enough to ride out a failover (detection ~0.4 s, election ~0.2 s, the gateway
# waiting for the new master) or a gateway restart several times over, short enough that
# an app hears back.
RETRY_TOTAL_MS_MAX_DEFAULT = 10_000


@dataclass(frozen=True)
class RetryPolicy:
    """How far an indeterminate call is retried: a time budget, with backoff between tries.

    The budget is time: no retry starts once total_ms_max has passed since the first
    attempt began. The wait before retry n (n = 1, 2, ...) is drawn uniformly from 0 to
    min(backoff_max_ms, backoff_initial_ms * 2**(n-1)) ("full jitter"). attempts_max is an
    optional cap on the attempts in all: 0 (the default) is no cap, 1 turns retrying off.
    """

    attempts_max: int = RETRY_ATTEMPTS_MAX_DEFAULT
    backoff_initial_ms: int = RETRY_BACKOFF_INITIAL_MS_DEFAULT
    backoff_max_ms: int = RETRY_BACKOFF_MAX_MS_DEFAULT
    total_ms_max: int = RETRY_TOTAL_MS_MAX_DEFAULT

    def validate(self, prefix: str = "retry_") -> None:
        """Raises ValueError naming the first field out of bounds (as `prefix` + name)."""
        for name, (low, high) in POLICY_BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{prefix}{name} must be an integer, got {value!r}")
            if not low <= value <= high:
                raise ValueError(f"{prefix}{name} must be from {low} to {high}, got {value}")
        if self.backoff_initial_ms > self.backoff_max_ms:
            raise ValueError(
                f"{prefix}backoff_initial_ms must not exceed {prefix}backoff_max_ms "
                f"({self.backoff_max_ms}), got {self.backoff_initial_ms}"
            )

    @property
    def retries(self) -> bool:
        """False when the policy allows one attempt only (retrying is off)."""
        return self.attempts_max != 1

    def exhausted(self, attempts: int, elapsed_ms: float) -> bool:
        """True once no further attempt may start.

        `attempts` were made so far (the first included); `elapsed_ms` have passed since
        the first one began. The time budget decides; attempts_max only when set.
        """
        if self.attempts_max and attempts >= self.attempts_max:
            return True
        return elapsed_ms >= self.total_ms_max

    def backoff_ceiling_ms(self, retry_number: int) -> int:
        """The longest wait before retry `retry_number` (1 for the first retry)."""
        if retry_number < 1:
            raise ValueError(f"retry_number starts at 1, got {retry_number}")
        # Capped before exponentiating, so a large retry number cannot build a huge int.
        doublings = min(retry_number - 1, 32)
        return min(self.backoff_max_ms, self.backoff_initial_ms << doublings)
