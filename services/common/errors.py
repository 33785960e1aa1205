"""Errors a service answers with: each carries the gRPC status code a client will see.

Core modules raise these without importing grpc; the thin servicers turn them into
statuses. Keeping the code on the error means every refusal is decided once, where the
reason is known, and reaches the client unchanged through the gateway.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """The gRPC status codes Squall answers with (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    # "May or may not have happened": the client may retry with the same
    # (publisher_id, sequence), and must not treat it as a definite failure.
    UNKNOWN = "UNKNOWN"


# Set (to INLINE_ERRORS) on a PublishStream whose failed requests are answered with a
# PublishResponse.error and do not end the stream: the gateway's stream shared between
# callers (services/gateway/shared_publish.py), where one caller's refusal must not end
# the others' requests.
PUBLISH_ERRORS_KEY = "squall-publish-errors"
INLINE_ERRORS = "inline"


class ServiceError(Exception):
    """A refusal with the status code and one-sentence message the client receives."""

    def __init__(self, code: Code, message: str, *, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        # Trailing metadata for the client (e.g. where the master is, on a redirect).
        self.metadata = metadata


def invalid(message: str) -> ServiceError:
    """INVALID_ARGUMENT: the request itself is wrong; retrying it cannot help."""
    return ServiceError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    """NOT_FOUND: the named topic or subscription does not exist."""
    return ServiceError(Code.NOT_FOUND, message)
