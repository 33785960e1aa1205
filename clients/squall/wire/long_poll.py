"""How long a call may wait because its own request asks it to.

A shared subscription's `Pull` waits up to its `wait_ms` for an event when none is ready,
at most `PULL_WAIT_MAX_MS`, and then answers (empty). Every hop's deadline must cover that
wait on top of its own: if the library's call (its `timeout_s`) or the gateway's forward
(`timeouts.publish_timeout_ms`, its deadline for every forwarded call) ended first, the
call would fail with `DEADLINE_EXCEEDED` and be retried, though nothing went wrong. The
master, for its part, answers before its caller's deadline
(`squall_server.replica.shared_master`).
"""

from __future__ import annotations

# The longest a Pull waits for an event: a larger PullRequest.wait_ms is capped to it.
PULL_WAIT_MAX_MS = 30_000
# The gRPC method whose request names such a wait.
PULL_METHOD = "/squall.v1.Subscriber/Pull"


def pull_wait_s(wait_ms: int) -> float:
    """The seconds a Pull asking to wait wait_ms may take before it answers."""
    return min(max(wait_ms, 0), PULL_WAIT_MAX_MS) / 1000
