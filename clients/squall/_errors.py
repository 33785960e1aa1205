"""The errors the Squall client raises, and the one function that decides what a failure means.

Every failed call surfaces as a `SquallError` carrying the gRPC status code and the
server's details. The tree::

    SquallError                 base; .code (grpc.StatusCode), .details (str)
    ├── NotFound                the topic or subscription does not exist
    ├── AlreadyExists           the topic already exists
    │   └── AlreadySubscribed   the push subscriber id is already subscribed to the topic
    ├── InvalidArgument         the request is wrong (bad name, event too large); a retry fails too
    ├── ResourceExhausted       a limit was hit (topic map full, message too large, quota)
    ├── PermissionDenied        the caller may not do this
    ├── Unauthenticated         the caller is not authenticated
    ├── FailedPrecondition      the cluster cannot do this now (no quorum, wrong state)
    ├── Unavailable             nothing was sent, or a read/admin call found no server
    │   └── PublisherLost       a non-replicated publisher's master is gone; get a new
    │                           publisher (.maybe_stored says whether this batch may be in)
    ├── DeadlineExceeded        a read/admin call ran out of time
    └── Indeterminate           a publish that was sent may or may not have been stored, and
                                the publisher's retries (same ids and sequences) ran out
                                (.maybe_stored is True; .code is UNKNOWN, DEADLINE_EXCEEDED,
                                UNAVAILABLE, CANCELLED or INTERNAL)

Any other status code raises the base `SquallError`.

`Indeterminate` is a result of its own, never folded into "failed": the events may be
in the topic. Republishing them with the same publisher id and sequences is safe, because
the master deduplicates on `(publisher_id, sequence)`. `classify` decides between success,
definite failure and indeterminate; it wraps the pure `squall.wire.retry.classify`, which works
on code names so the gateway shares the very same rule.
"""

from __future__ import annotations

import grpc

from squall.wire import retry as wire_retry
from squall.wire.retry import Outcome


def classify(code: grpc.StatusCode, sent: bool) -> Outcome:
    """Says whether a call ended in success, a definite failure, or an unknown outcome.

    `sent` is whether the request may have reached a server; a request that never left
    the client failed definitely, whatever the code. The decision itself is the pure
    `squall.wire.retry.classify`, shared with the gateway.
    """
    return wire_retry.classify(code.name, sent)


class SquallError(Exception):
    """A failed Squall call: the gRPC status code and the server's explanation."""

    maybe_stored: bool = False

    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.details} ({self.code.name})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.details!r}, {self.code})"


class NotFound(SquallError):
    """The topic or subscription named does not exist."""


class AlreadyExists(SquallError):
    """The topic to create already exists."""


class AlreadySubscribed(AlreadyExists):
    """The push subscriber id is already subscribed to the topic (IceStorm's AlreadySubscribed)."""


class InvalidArgument(SquallError):
    """The request is malformed or breaks a limit; the same request will fail again."""


class ResourceExhausted(SquallError):
    """A configured limit was reached (topic map full, message size, quota)."""


class PermissionDenied(SquallError):
    """The caller is not allowed to do this."""


class Unauthenticated(SquallError):
    """The caller did not authenticate."""


class FailedPrecondition(SquallError):
    """The cluster is not in a state that allows this call (for example, no quorum)."""


class Unavailable(SquallError):
    """No server could take the call; for a publish, nothing was sent."""


class PublisherLost(Unavailable):
    """A non-replicated publisher lost its master: no silent failover, ask for a new publisher.

    `maybe_stored` is True for a batch that was in flight when the master went (it may
    be stored; republishing it with the same publisher id and sequences is safe), False
    for one that was never sent.
    """

    def __init__(
        self,
        details: str,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        *,
        maybe_stored: bool = False,
    ) -> None:
        super().__init__(details, code)
        self.maybe_stored = maybe_stored


class Aborted(SquallError):
    """A concurrent change won (an ack of messages delivered before a seek): nothing changed."""


class DeadlineExceeded(SquallError):
    """A read or admin call did not finish in time."""


class Indeterminate(SquallError):
    """A sent publish whose outcome is unknown: the events may or may not have been stored."""

    maybe_stored = True


_BY_CODE: dict[grpc.StatusCode, type[SquallError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.ABORTED: Aborted,
}


def error_for(code: grpc.StatusCode, details: str, *, sent: bool = False) -> SquallError:
    """Builds the error for a status code; `sent=True` marks a write that may have landed."""
    if classify(code, sent) == "indeterminate":
        return Indeterminate(details, code)
    return _BY_CODE.get(code, SquallError)(details, code)


def rpc_status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a failed call (UNKNOWN when gRPC gives none)."""
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    if not isinstance(details, str) or not details:
        details = str(err) or code.name.lower()
    return code, details


def from_rpc_error(err: grpc.RpcError, *, sent: bool = False) -> SquallError:
    """Turns a grpc.RpcError into the matching SquallError.

    Pass `sent=True` for a publish that may have reached a server, so that a broken
    connection or a passed deadline becomes `Indeterminate` rather than a definite failure.
    """
    code, details = rpc_status(err)
    return error_for(code, details, sent=sent)
