"""How ``make test`` spreads the in-process tests over its two xdist workers: a file at a
time, as ``--dist loadfile`` does (a module's fixtures are built once, its tests run in
order on one worker), except that each chunk of a simulator's seeds is a unit of its own,
so the seeds of one simulator run on both workers at once.

A seed chunk is a test parametrized with an id made by ``seed_chunk_id`` (``seeds-0-49``);
``tests/sim/seed_runs.py`` makes those. xdist orders units by their number of tests, most
first, so the one-test chunks come last, where short units even out the workers' ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SEED_CHUNK_PREFIX = "seeds-"


def seed_chunk_id(seeds: Sequence[int]) -> str:
    """The parametrize id of a chunk of consecutive seeds: ``seeds-100-149``."""
    return f"{SEED_CHUNK_PREFIX}{seeds[0]}-{seeds[-1]}"


def is_seed_chunk(nodeid: str) -> bool:
    """Whether a test id is a seed chunk's (its parameters start with the prefix)."""
    return f"[{SEED_CHUNK_PREFIX}" in nodeid


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's file-at-a-time scheduler with seed chunks as units of their own (only for
    ``--dist loadfile``; None leaves every other mode to xdist)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrSeedChunkScheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if is_seed_chunk(nodeid):
                return nodeid
            scope: str = super()._split_scope(nodeid)
            return scope

    return FileOrSeedChunkScheduling(config, log)
