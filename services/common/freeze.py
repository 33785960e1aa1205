"""How long a clean shutdown's freeze may hold a replica (`squall cluster shutdown`).

The replica enforces it (services/replica/shutdown.py); the command bounds its --timeout
by it (services/cli/cluster_shutdown.py). Here, apart from both, so that the command does
not load the replica's code to read two numbers.
"""

from __future__ import annotations

# How long a freeze holds when the command names no hold (an older release's), and the
# longest it may ask for: a shutdown that never finishes must not freeze a cluster for good.
FREEZE_HOLD_DEFAULT_MS = 120_000
FREEZE_HOLD_MAX_MS = 3_600_000
