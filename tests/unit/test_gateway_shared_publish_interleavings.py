"""The gateway's shared publish stream under random interleavings (issue 16, item 5).

Goal: whatever order callers arrive, give up, and the master answers, refuses or breaks
the stream in, every caller of the link (`SharedPublishStream`) hears exactly one
outcome, and it is true:

* a response is the one the master gave for that caller's own request (alone, or its
  part of a joined one), never another's;
* "not forwarded" (`forwarded=False`) only for a request that was never written, alone
  or as a part: the forwarder may then answer it as not applied;
* a refusal is the master's refusal of that caller's request, as the master gave it;
* nothing waits for ever: once the master stops, every caller has heard, and every slot
  is free again.

Seeded, in process, deterministic: the link's real code against the scripted stream of
tests/unit/test_gateway_shared_publish.py, no clock (callers give up by cancellation).
`SEED=S` replays one seed.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

import grpc
import pytest

from squall.v1 import broker_pb2
from squall_server.gateway.shared_publish import Joining, SharedPublishStream, SharedStreamError
from tests.unit.test_gateway_shared_publish import (
    ADDRESS,
    FakeCall,
    FakeMasters,
    inline_error,
    receipt,
    request,
    settle,
)

SEEDS = 200
STEPS = 60


@dataclass
class _Run:
    """One seed: the callers, what the master was written and what it answered."""

    masters: FakeMasters
    link: SharedPublishStream
    rng: random.Random
    tasks: dict[int, asyncio.Task[bytes]] = field(default_factory=dict)
    # Callers' requests by caller index, and the caller index of a request's bytes.
    requests: dict[int, bytes] = field(default_factory=dict)
    owner: dict[bytes, int] = field(default_factory=dict)
    # What the master answered each caller's request (bytes, or a refusal's code).
    answered: dict[int, bytes | str] = field(default_factory=dict)
    # Callers whose request the master has read (alone or as a part).
    written: set[int] = field(default_factory=set)
    # Requests read so far on each stream, by the stream's index.
    read: dict[int, int] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)

    def arrive(self) -> None:
        for _ in range(self.rng.randint(1, 4)):  # callers come in bursts, as apps' do
            index = len(self.requests)
            raw = request(f"p{index}", 1)
            self.requests[index] = raw
            self.owner[raw] = index
            self.tasks[index] = asyncio.create_task(self.link.publish(raw, None))

    def _unread(self) -> tuple[FakeCall, list[int]] | None:
        """The open stream's oldest request not answered yet: its callers."""
        if not self.masters.calls:
            return None
        number = len(self.masters.calls) - 1
        call = self.masters.calls[number]
        at = self.read.get(number, 0)
        if call.done or at >= len(call.written):
            return None
        self.read[number] = at + 1
        callers = self._callers(call.written[at])
        for caller in callers:
            assert caller not in self.written, f"caller {caller}'s request was written twice"
            self.written.add(caller)
        return call, callers

    def _callers(self, raw: bytes) -> list[int]:
        parts = broker_pb2.PublishRequest.FromString(raw).parts
        return [self.owner[p.SerializeToString()] for p in parts] or [self.owner[raw]]

    def on_the_wire(self) -> set[int]:
        """Callers whose request was written to any stream, alone or as a part."""
        return {
            c for call in self.masters.calls for raw in call.written for c in self._callers(raw)
        }

    def unanswered(self) -> int:
        """Publishes written to the open stream that the master has not answered."""
        if not self.masters.calls or self.masters.calls[-1].done:
            return 0
        call = self.masters.calls[-1]
        at = self.read.get(len(self.masters.calls) - 1, 0)
        return sum(len(self._callers(raw)) for raw in call.written[at:])

    def answer(self) -> None:
        """The master answers the oldest request: receipts, or a caller's refusal."""
        taken = self._unread()
        if taken is None:
            return
        call, callers = taken
        answers: list[bytes] = []
        for caller in callers:
            if self.rng.random() < 0.2:
                answers.append(inline_error("NOT_FOUND", f"no topic for p{caller}"))
                self.answered[caller] = "NOT_FOUND"
            else:
                answers.append(receipt(caller))
                self.answered[caller] = receipt(caller)
        if len(callers) == 1:
            call.answer(answers[0])
            return
        if self.rng.random() < 0.1:  # refused as a whole: nothing of it applied
            for caller in callers:
                self.answered[caller] = "WHOLE"
            call.answer(inline_error("INVALID_ARGUMENT", "too many parts"))
            return
        call.answer(
            broker_pb2.PublishResponse(
                parts=[broker_pb2.PublishResponse.FromString(a) for a in answers]
            ).SerializeToString()
        )

    def break_stream(self) -> None:
        if self.masters.calls and not self.masters.calls[-1].done:
            code = self.rng.choice(
                [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED]
            )
            if code == grpc.StatusCode.ABORTED:
                # A definite status ends a stream at the request it refuses: the oldest
                # unanswered (PublishStream's contract); nothing of it was applied.
                taken = self._unread()
                for caller in taken[1] if taken else ():
                    self.answered[caller] = "ABORTED"
            self.masters.calls[-1].end(code, "scripted end")

    def move(self) -> None:
        self.masters.moved.set()

    def give_up(self) -> None:
        waiting = [i for i, t in self.tasks.items() if not t.done()]
        if waiting:
            index = self.rng.choice(waiting)
            self.cancelled.add(index)
            self.tasks[index].cancel()


async def _run(seed: int) -> None:
    rng = random.Random(seed)
    masters = FakeMasters()
    inflight = rng.randint(2, 8)
    joining = Joining(
        window=rng.randint(1, 3), parts_max=rng.randint(1, 5), bytes_max=rng.choice([40, 4096])
    )
    link = SharedPublishStream(
        masters,  # type: ignore[arg-type]
        ADDRESS,
        (),
        inflight,
        "l1",
        joining,
    )
    run = _Run(masters, link, rng)
    actions = [run.arrive] * 6 + [run.answer] * 8 + [run.give_up] * 2 + [run.break_stream, run.move]
    try:
        for _ in range(STEPS):
            rng.choice(actions)()
            if masters.moved.is_set():
                await settle()
                masters.moved = asyncio.Event()  # later streams follow the new master
            await settle()
            # A caller that gave up keeps its slot until the master answers: the master
            # never holds more than the link's bound.
            unanswered = run.unanswered()
            if unanswered > inflight:
                raise AssertionError(f"{unanswered} publishes unanswered, bound {inflight}")
        # The master answers what it still has, then stops: every caller must hear.
        for _ in range(4 * len(run.requests) + 4):  # bounded: each turn reads one request
            run.answer()
            await settle()
        run.break_stream()
        await settle()
        for _ in range(len(run.requests) + 1):  # waiting callers open a stream, broken
            run.break_stream()
            await settle()
        hung = [i for i, t in run.tasks.items() if not t.done()]
        assert not hung, f"callers {hung} never heard"
        for index, task in run.tasks.items():
            _check(run, index, task)
        assert link._slots._value == inflight, "a slot was never given back"
    finally:
        await link.close()


def _check(run: _Run, index: int, task: asyncio.Task[bytes]) -> None:
    if task.cancelled():
        assert index in run.cancelled, f"caller {index} cancelled by nobody"
        return
    error = task.exception()
    master_said = run.answered.get(index)
    sent = index in run.on_the_wire()
    if error is None:
        assert task.result() == master_said == receipt(index), (
            f"caller {index} heard {task.result()!r}, the master answered {master_said!r}"
        )
        return
    assert isinstance(error, SharedStreamError), repr(error)
    if not error.forwarded:
        assert not sent or master_said in ("WHOLE", "ABORTED"), (
            f"caller {index} heard 'not forwarded' ({error.details}) but was written"
        )
    if master_said == "NOT_FOUND":
        assert error.code == "NOT_FOUND" and error.details == f"no topic for p{index}"
    elif master_said == "WHOLE":
        assert not error.forwarded and error.collateral, error
        assert not run.link.joining
    elif master_said == "ABORTED":
        # Alone: the refusal as it came; joined: sent again alone (it may be the joining's).
        assert error.code == "ABORTED" or (not error.forwarded and error.collateral), error
    elif isinstance(master_said, bytes):
        raise AssertionError(f"caller {index} heard {error!r}, the master answered receipts")
    else:
        assert error.code != "NOT_FOUND", f"caller {index} heard another's refusal"


def test_every_caller_hears_its_own_outcome_under_random_interleavings() -> None:
    seeds = [int(os.environ["SEED"])] if os.environ.get("SEED") else range(SEEDS)
    failed: dict[int, str] = {}
    for seed in seeds:
        try:
            asyncio.run(asyncio.wait_for(_run(seed), 10))
        except (AssertionError, TimeoutError) as exc:
            failed[seed] = f"{type(exc).__name__}: {exc}"
    if failed:
        pytest.fail(
            f"{len(failed)} seeds failed (replay one with SEED=S): "
            + "; ".join(f"{s}: {m[:300]}" for s, m in list(failed.items())[:5]),
            pytrace=False,
        )
