"""Which forwarded calls the gateway retries, and what it answers when retrying ends.

A pure core (STYLE.md point 1): it works on method names, status code names and a request's
bytes, and imports no grpc, asyncio, clock or randomness. The meaning of one attempt's
status is the client library's rule (`squall.classify_code`, `squall.retryable`,
`squall.overall`), so the gateway and the library cannot disagree. The driver that sleeps
and calls is `squall_server.gateway.forward`.

The rules (issue 5, item 3; STYLE.md point 6):

* Only an indeterminate attempt (UNAVAILABLE, UNKNOWN, DEADLINE_EXCEEDED, CANCELLED or
  INTERNAL once the request may have left) is retried, and only when repeating the request
  cannot apply it twice: a read; an `Ack` (the cursor only moves forward); a `Publish`
  whose events all carry a sequence under a publisher id (the master deduplicates).
* `CreateTopic`, `DestroyTopic`, `DeleteSubscription`, `SubscribeAndGetPublisher` and
  `Unsubscribe` are not retried on an indeterminate outcome; the status goes back to the
  app as it came. Repeating them is not safe: if the lost attempt destroyed a topic and
  another client created it again before the retry, the retry would destroy the new one
  (and `ALREADY_EXISTS` / `NOT_FOUND` on a retry could not tell "my lost attempt did
  it" from "someone else did").
* Any call a slave refused with a redirect (UNAVAILABLE plus `squall-master-address`) is
  sent again to the master it names: the slave applied nothing.
* Streams (`PublishStream`, `Subscribe`) are never retried here; the library retries them.
* When a call with effects ends in a definite failure after an attempt that may have been
  applied, the gateway answers UNKNOWN, not the definite code: the lost attempt may have
  stored the events, and the app must hear "may have happened".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from google.protobuf.message import DecodeError

from squall.v1 import broker_pb2
from squall.wire.retry import Outcome, overall, retryable
from squall.wire.retry import classify as classify_code

MethodKind = Literal["read", "idempotent", "publish", "once", "stream"]
Action = Literal["answer", "retry"]

# Every forwarded broker method. A method missing here (added to the proto later) is
# treated as "once": retried only after a redirect.
METHOD_KINDS: Mapping[str, MethodKind] = {
    "CreateTopic": "once",
    "RetrieveTopic": "read",
    "ListTopics": "read",
    "DestroyTopic": "once",
    "GetPublisher": "read",
    "GetNonReplicatedPublisher": "read",
    # A repeated link would answer ALREADY_EXISTS for the app's own lost attempt, and a
    # repeated unlink could remove a link made again in between: the app decides.
    "LinkTopic": "once",
    "UnlinkTopic": "once",
    "GetLinkInfo": "read",
    # A repeated retry finds the link forwarding and answers ok.
    "RetryLink": "idempotent",
    "Publish": "publish",
    "PublishStream": "stream",
    "Subscribe": "stream",
    "Ack": "idempotent",
    # A repeated seek lands where the first did; at worst it moves the cursor back over
    # acks made in between, which redelivers them (at-least-once, nothing lost).
    "Seek": "idempotent",
    "ListSubscriptions": "read",
    # Same settings answer ok, so a repeated create is harmless.
    "CreateSharedSubscription": "idempotent",
    # A repeated pull leases more events to the consumer; those its lost answer held are
    # delivered again after their deadline (at-least-once, nothing lost).
    "Pull": "idempotent",
    # An offset already acknowledged answers ok.
    "AckMessages": "idempotent",
    # A repeated nack would count a failed delivery twice.
    "Nack": "once",
    # A repeated extension sets the same kind of deadline again.
    "ExtendDeadline": "idempotent",
    "DeleteSubscription": "once",
    # A repeated subscribe would answer AlreadySubscribed for the app's own lost attempt,
    # a repeated unsubscribe NOT_FOUND: the app decides (docs/push-subscribers.md).
    "SubscribeAndGetPublisher": "once",
    "Unsubscribe": "once",
    "GetSubscribers": "read",
}


def method_kind(method: str) -> MethodKind:
    """How a broker method (by its short name, e.g. "Publish") may be retried."""
    return METHOD_KINDS.get(method, "once")


def publish_deduplicated(request: bytes) -> bool:
    """True if the master deduplicates every event of this serialized PublishRequest.

    That needs a publisher id and a non-zero sequence on each event (0 means "no
    deduplication"). A request that does not parse is not deduplicated (the master
    refuses it anyway, definitely).
    """
    try:
        parsed = broker_pb2.PublishRequest.FromString(request)
    except DecodeError:
        return False
    if not parsed.publisher_id or not parsed.events:
        return False
    return all(event.sequence for event in parsed.events)


def repeatable(method: str, request: bytes) -> bool:
    """True if sending this request again cannot apply it twice."""
    kind = method_kind(method)
    if kind in ("read", "idempotent"):
        return True
    if kind == "publish":
        return publish_deduplicated(request)
    return False


def has_effects(method: str) -> bool:
    """True for calls that change state (all but reads)."""
    return method_kind(method) != "read"


def after_attempt(code: str, *, redirected: bool, safe: bool) -> Action:
    """Retry or answer, after one forwarded attempt ended with status `code`.

    `redirected`: a slave refused the call and named the master. `safe`: `repeatable()`.
    """
    if code == "OK":
        return "answer"
    if redirected:
        return "retry"
    if retryable(classify_code(code, sent=True), deduplicated=safe):
        return "retry"
    return "answer"


def attempt_outcome(code: str, *, redirected: bool, forwarded: bool = True) -> Outcome:
    """One attempt's outcome: a redirect or a call never forwarded applied nothing."""
    if redirected or not forwarded:
        return "definite"
    return classify_code(code, sent=True)


def answer_code(outcomes: Sequence[Outcome], code: str, *, effects: bool) -> str:
    """The status code to answer with when retrying ends on an attempt that ended `code`.

    A definite failure after an earlier attempt that may have been applied becomes UNKNOWN
    for a call with effects; everything else is answered as it came.
    """
    if effects and code != "OK" and overall(outcomes) == "indeterminate":
        if classify_code(code, sent=True) == "definite":
            return "UNKNOWN"
    return code
