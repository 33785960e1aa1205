"""The Squall server (the `squall_server` package; its code lives in services/)."""

from __future__ import annotations

import os

# gRPC's I/O path for every service process. gRPC reads GRPC_EXPERIMENTS once, when it
# is first imported, so it is set here, before any service module imports it (an
# operator's own value wins). Since grpcio 1.80 its EventEngine carries Python's TCP
# reads and writes on threads of its own and hands each message to the thread waiting
# for it; with these off, the waiting thread does its own I/O (the path of grpcio before
# 1.80): a thread hop fewer per message on each side, each network leg of a publish
# 0.7-0.8x (bench/README.md, *gRPC's I/O path*).
GRPC_EXPERIMENTS_DEFAULT = (
    "-event_engine_client,-event_engine_listener,"
    "-event_engine_for_all_other_endpoints,-event_engine_callback_cq"
)
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT)
