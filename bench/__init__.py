"""Squall's benchmarks (bench/README.md).

gRPC is imported first, so a bench process (the app's side of every measurement) runs
with gRPC's own defaults, as an app does, whatever `squall_server` sets for the services
it starts (services/__init__.py).
"""

import grpc  # noqa: F401
