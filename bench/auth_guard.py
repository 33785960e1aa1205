"""What the call guards cost per call, without gRPC: `python -m bench.auth_guard`.

Every public call passes squall_server.common.call_guard: the per-client limits always, the
token and permission check when [auth] is on (the gateway then also decodes the request
to read its topic). This times one unary publish of a 1 KiB request, as the gateway sees
it (serialized bytes), through the guards alone, with N principals configured. A
measurement, not a test; the best of several rounds is printed, in microseconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.auth import token_sha256
from squall_server.common.auth_config import AuthConfig, PrincipalConfig
from squall_server.common.call_guard import AuthGuard, Call, ClientLimitsGuard, Guard, Request
from squall_server.common.config import LimitsConfig

_METHOD = "/squall.v1.Publisher/Publish"
_TOKEN = "bench-token"


class _Context:
    """The two things the guards read from a servicer context."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {_TOKEN}"),)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"


def _round(guards: Sequence[Guard], raw: bytes, calls: int) -> float:
    """Microseconds per call through the guards."""
    context: Any = _Context()
    started = time.perf_counter()
    for _ in range(calls):
        call = Call(_METHOD, context, streaming=False, member=None)
        sessions = [s for s in (g.open(call) for g in guards) if s is not None]
        request = Request(_METHOD, raw)
        for session in sessions:
            session.request(request)
        for session in sessions:
            session.response(None)
            session.close()
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    """Prints the guard cost per call with auth on and off."""
    parser = argparse.ArgumentParser(prog="bench.auth_guard", description=__doc__)
    parser.add_argument("--principals", type=int, default=100, help="principals configured")
    parser.add_argument("--calls", type=int, default=20_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the best is printed)")
    args = parser.parse_args(argv)
    principals = [
        PrincipalConfig(f"p{i}", token_sha256(f"other-{i}"), publish=("orders.*",))
        for i in range(args.principals - 1)
    ]
    principals.append(PrincipalConfig("bench", token_sha256(_TOKEN), publish=("orders.*",)))
    raw = broker_pb2.PublishRequest(
        topic="orders.eu",
        events=[common_pb2.EventData(payload=b"x" * 100, sequence=i) for i in range(10)],
    ).SerializeToString()
    limits = ClientLimitsGuard(LimitsConfig(), auth_enabled=True)
    auth = AuthGuard(AuthConfig(enabled=True, principals=tuple(principals)))
    runs: list[tuple[str, list[Guard]]] = [
        ("auth on (token + topic + limits)", [auth, limits]),
        ("auth off (limits only)", [limits]),
    ]
    for label, guards in runs:
        best = min(_round(guards, raw, args.calls) for _ in range(args.rounds))
        print(
            f"{label}: {best:.1f} us per call ({len(raw)}-byte request, "
            f"{args.principals} principals)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
