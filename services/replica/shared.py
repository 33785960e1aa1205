"""The delivery rules of one shared subscription (competing consumers): a pure core.

The master's driver (services/replica/shared_master.py) serves it; docs/consumers.md,
"Shared subscriptions", describes the whole. It holds what the master decides for a
shared subscription, with time and consumers as plain inputs, so that the rules are tested
deterministically:

* `pull` hands a consumer offsets, each with a lease until `now + ack_deadline_ms`: first
  those due for redelivery (nacked after their delay, or whose lease lapsed), in the order
  they became due, then offsets never handed out, in offset order, skipping the acked.
* `ack` marks offsets done; `nack` and a lapsed lease (`tick`) count a failed delivery,
  and an offset whose failures reach `max_deliveries` is dead-lettered instead of being
  offered again. Every change the cluster must remember (acks, failures, dead letters) is
  returned, for the driver to write as log entries; leases stay in the master's memory.
* Exclusive mode: one consumer holds the subscription and gets offsets in order; another
  takes over once the holder has not pulled for `exclusive_takeover_ms`.
* Bad input changes nothing: an ack or nack of an offset leased to another consumer is
  FAILED_PRECONDITION naming the holder; of an offset never delivered, INVALID_ARGUMENT.
  Deliveries name the master's epoch and acks send it back: this master knows what it
  handed out in its own epoch, but not what an earlier master did (deliveries are not
  logged), so an ack from an earlier epoch is refused only when the offset is leased to
  another consumer now, or was never committed.

State replicated through the log (the floor, acked offsets above it, failure counts and
last errors) comes in through the constructor, so a new master starts from what was
committed: everything not acknowledged is delivered again, nothing acknowledged is.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from squall_server.common.errors import Code, ServiceError, invalid

# The error recorded for a delivery whose ack deadline passed.
DEADLINE_ERROR = "ack deadline passed"
# Who acknowledged an offset is remembered this many offsets below the floor, so that a late
# ack from another consumer (its lease lapsed, or a failover) is refused, not counted twice.
ACKED_BY_RETAIN = 10_000
# The `acked_by` value of a dead-lettered offset.
DEAD_LETTERED = ""


@dataclass(frozen=True)
class SharedConfig:
    """A shared subscription's rules (replicated with it)."""

    ack_deadline_ms: int
    max_deliveries: int
    exclusive: bool = False
    # Exclusive mode: how long a holder that stopped pulling keeps the subscription.
    exclusive_takeover_ms: int = 0
    # Most offsets one consumer may hold at once (its flow control, checked here too).
    outstanding_max: int = 1000

    def check(self) -> None:
        """INVALID_ARGUMENT naming the first bad field."""
        if self.max_deliveries < 1:
            raise invalid(f"max_deliveries must be >= 1, not {self.max_deliveries}")
        if self.ack_deadline_ms < 1:
            raise invalid(f"ack_deadline_ms must be >= 1, not {self.ack_deadline_ms}")
        if self.outstanding_max < 1:
            raise invalid(f"outstanding_max must be >= 1, not {self.outstanding_max}")
        if self.exclusive_takeover_ms < 0:
            raise invalid(f"exclusive_takeover_ms must be >= 0, not {self.exclusive_takeover_ms}")


@dataclass(frozen=True)
class Delivery:
    """One offset handed to a consumer."""

    offset: int
    consumer_id: str
    attempt: int  # 1 for the first delivery
    deadline_ms: int
    epoch: int  # the master's epoch: acks and nacks send it back


@dataclass(frozen=True)
class DeadLetter:
    """An offset that exhausted max_deliveries: publish it to the dead-letter topic."""

    offset: int
    deliveries: int
    last_error: str


@dataclass
class Changes:
    """What the cluster must remember, in this order: failures, dead letters, acks."""

    acked: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)


@dataclass
class _Lease:
    consumer_id: str
    deadline_ms: int


class SharedSubscription:
    """The master's view of one shared subscription (see the module docstring)."""

    def __init__(
        self,
        config: SharedConfig,
        *,
        epoch: int,
        floor: int,
        committed_end: int,
        acked: Iterable[int] = (),
        failures: Mapping[int, int] | None = None,
        last_errors: Mapping[int, str] | None = None,
        acked_by: Mapping[int, str] | None = None,
    ) -> None:
        config.check()
        self.config = config
        self._epoch = epoch
        self._floor = floor
        self._end = max(committed_end, floor)
        self._done: set[int] = {o for o in acked if o >= floor}
        self._failures: dict[int, int] = {o: n for o, n in (failures or {}).items() if o >= floor}
        self._errors: dict[int, str] = dict(last_errors or {})
        # offset -> the consumer that acked it (DEAD_LETTERED: dead-lettered), kept
        # ACKED_BY_RETAIN offsets below the floor.
        self._acked_by: dict[int, str] = dict(acked_by or {})
        self._leases: dict[int, _Lease] = {}
        self._due: list[tuple[int, int]] = []  # (ready_ms, offset), a heap
        self._due_at: dict[int, int] = {}  # offset -> ready_ms of its current due entry
        self._next_new = floor  # the lowest offset not yet handed out by this master
        self._holder: str | None = None
        self._holder_seen_ms = 0
        self._dead_lettered = 0
        # Offsets failed before this master (replicated failures) are due at once.
        for offset in sorted(self._failures):
            if offset not in self._done:
                self._make_due(offset, 0)
        self._advance_floor()

    # --- what the driver reads

    @property
    def floor(self) -> int:
        """Every offset below it is acknowledged or dead-lettered (the subscription's cursor)."""
        return self._floor

    def outstanding(self, consumer_id: str | None = None) -> int:
        """Offsets leased now (to one consumer, or to any)."""
        if consumer_id is None:
            return len(self._leases)
        return sum(1 for lease in self._leases.values() if lease.consumer_id == consumer_id)

    @property
    def dead_lettered(self) -> int:
        """Offsets this master dead-lettered."""
        return self._dead_lettered

    @property
    def holder(self) -> str | None:
        """Exclusive mode: the consumer holding the subscription."""
        return self._holder

    def next_deadline_ms(self) -> int | None:
        """When `tick` next has something to do (a lease lapsing, a holder's takeover)."""
        times = [lease.deadline_ms for lease in self._leases.values()]
        if self._holder is not None and self.config.exclusive:
            times.append(self._holder_seen_ms + self.config.exclusive_takeover_ms)
        return min(times) if times else None

    # --- inputs

    def committed(self, end: int) -> None:
        """The topic's events below `end` are committed and may be handed out."""
        self._end = max(self._end, end)

    def pull(self, consumer_id: str, max_messages: int, now_ms: int) -> list[Delivery]:
        """Offsets for `consumer_id`, at most max_messages and its outstanding limit."""
        if max_messages < 1:
            raise invalid(f"max_messages must be >= 1, not {max_messages}")
        if self.config.exclusive and not self._take_hold(consumer_id, now_ms):
            return []
        room = min(max_messages, self.config.outstanding_max - self.outstanding(consumer_id))
        out: list[Delivery] = []
        if room < 1:
            return out
        if self.config.exclusive:
            candidates = self._in_order(now_ms)
        else:
            candidates = self._due_then_new(now_ms)
        # The generators hand out one offset per step: stop right after the last one fits.
        for offset in candidates:
            out.append(self._lease(offset, consumer_id, now_ms))
            if len(out) >= room:
                break
        return out

    def ack(self, consumer_id: str, offsets: Iterable[int], epoch: int) -> Changes:
        """Marks offsets done; the acks to log (an offset already done is not repeated).

        `epoch` is the one the deliveries named (Delivery.epoch).
        """
        wanted = sorted(set(offsets))
        for offset in wanted:
            self._check_held(consumer_id, offset, epoch, "ack")
        changes = Changes()
        for offset in wanted:
            if self._is_done(offset):
                continue  # a retried ack: already done
            self._finish(offset)
            self._acked_by[offset] = consumer_id
            changes.acked.append(offset)
        self._advance_floor()
        return changes

    def nack(
        self,
        consumer_id: str,
        offsets: Iterable[int],
        epoch: int,
        *,
        delay_ms: int,
        error: str,
        now_ms: int,
    ) -> Changes:
        """Counts a failed delivery of each offset; redelivers after delay_ms, or dead-letters."""
        if delay_ms < 0:
            raise invalid(f"a nack's delay must be >= 0 ms, not {delay_ms}")
        wanted = sorted(set(offsets))
        for offset in wanted:
            self._check_held(consumer_id, offset, epoch, "nack")
            if self._is_done(offset):
                raise ServiceError(
                    Code.FAILED_PRECONDITION, f"offset {offset} is already acknowledged"
                )
        changes = Changes()
        for offset in wanted:
            self._leases.pop(offset, None)
            self._fail(offset, error, now_ms + delay_ms, changes)
        self._advance_floor()
        return changes

    def tick(self, now_ms: int) -> Changes:
        """Lapsed leases become failed deliveries; a silent exclusive holder lets go."""
        changes = Changes()
        for offset in sorted(o for o, lease in self._leases.items() if lease.deadline_ms <= now_ms):
            lease = self._leases.pop(offset)
            self._fail(offset, f"{DEADLINE_ERROR} (consumer {lease.consumer_id})", now_ms, changes)
        if (
            self.config.exclusive
            and self._holder is not None
            and self._holder_seen_ms + self.config.exclusive_takeover_ms <= now_ms
            and not self.outstanding(self._holder)
        ):
            self._holder = None
        self._advance_floor()
        return changes

    def extend(
        self,
        consumer_id: str,
        offsets: Iterable[int],
        epoch: int,
        *,
        extension_ms: int,
        now_ms: int,
    ) -> int:
        """Moves the deadline of leases the consumer holds to now + extension_ms; returns it.

        Nothing changes when any offset is not leased to the consumer now.
        """
        if extension_ms < 1:
            raise invalid(f"a deadline extension must be >= 1 ms, not {extension_ms}")
        wanted = sorted(set(offsets))
        for offset in wanted:
            self._check_held(consumer_id, offset, epoch, "extend the deadline of")
            lease = self._leases.get(offset)
            if lease is None or lease.consumer_id != consumer_id:
                raise ServiceError(
                    Code.FAILED_PRECONDITION,
                    f"cannot extend the deadline of offset {offset}: consumer '{consumer_id}' "
                    "does not hold it (acknowledged, or its deadline passed)",
                )
        deadline = now_ms + extension_ms
        for offset in wanted:
            self._leases[offset].deadline_ms = deadline
        return deadline

    def release(self, consumer_id: str, offsets: Iterable[int]) -> None:
        """Takes back leases never handed to the consumer (an answer's byte limit): due
        again at once, no failure counted."""
        for offset in offsets:
            lease = self._leases.get(offset)
            if lease is not None and lease.consumer_id == consumer_id:
                del self._leases[offset]
                self._make_due(offset, 0)

    def seek(self, cursor: int) -> None:
        """A seek: the floor moves to `cursor`; every lease and count is dropped."""
        self._floor = self._next_new = cursor
        self._done.clear()
        self._acked_by.clear()
        self._failures.clear()
        self._errors.clear()
        self._leases.clear()
        self._due.clear()
        self._due_at.clear()

    # --- inside

    def _is_done(self, offset: int) -> bool:
        return offset < self._floor or offset in self._done

    def _check_held(self, consumer_id: str, offset: int, epoch: int, what: str) -> None:
        if self._is_done(offset):
            by = self._acked_by.get(offset)
            if by == DEAD_LETTERED:
                raise ServiceError(
                    Code.FAILED_PRECONDITION,
                    f"cannot {what} offset {offset}: it was dead-lettered after "
                    f"{self.config.max_deliveries} failed deliveries",
                )
            if by is not None and by != consumer_id:
                raise ServiceError(
                    Code.FAILED_PRECONDITION,
                    f"cannot {what} offset {offset}: consumer '{consumer_id}' does not hold "
                    f"it, consumer '{by}' acknowledged it (it was delivered again after the "
                    "ack deadline passed or a failover)",
                )
            return
        handed_out = offset < self._next_new or offset in self._failures
        if offset >= self._end or (epoch == self._epoch and not handed_out):
            raise invalid(f"cannot {what} offset {offset}: it was never delivered")
        if epoch > self._epoch:
            raise invalid(f"cannot {what} offset {offset}: epoch {epoch} is not yet")
        lease = self._leases.get(offset)
        if lease is not None and lease.consumer_id != consumer_id:
            raise ServiceError(
                Code.FAILED_PRECONDITION,
                f"cannot {what} offset {offset}: consumer '{consumer_id}' does not hold it, "
                f"consumer '{lease.consumer_id}' does (it was delivered again after "
                "the ack deadline passed)",
            )
        # Not leased: delivered before a failover, or its lease lapsed and it waits for
        # redelivery. The consumer did handle it, so the ack stands.

    def _finish(self, offset: int) -> None:
        self._done.add(offset)
        self._leases.pop(offset, None)
        self._failures.pop(offset, None)
        self._errors.pop(offset, None)
        self._due_at.pop(offset, None)

    def _fail(self, offset: int, error: str, ready_ms: int, changes: Changes) -> None:
        count = self._failures.get(offset, 0) + 1
        self._failures[offset] = count
        self._errors[offset] = error
        changes.failed.append((offset, error))
        if count >= self.config.max_deliveries:
            changes.dead_letters.append(DeadLetter(offset, count, error))
            self._dead_lettered += 1
            self._finish(offset)
            self._acked_by[offset] = DEAD_LETTERED
        else:
            self._make_due(offset, ready_ms)

    def _make_due(self, offset: int, ready_ms: int) -> None:
        self._due_at[offset] = ready_ms
        heapq.heappush(self._due, (ready_ms, offset))

    def _advance_floor(self) -> None:
        # Bounded by the offsets marked done: each step removes one.
        start = self._floor
        while self._floor in self._done:
            self._done.discard(self._floor)
            self._floor += 1
        self._next_new = max(self._next_new, self._floor)
        # Bounded by the floor's move: forget ackers far below it.
        for offset in range(max(0, start - ACKED_BY_RETAIN), self._floor - ACKED_BY_RETAIN):
            self._acked_by.pop(offset, None)

    def _due_then_new(self, now_ms: int) -> Iterable[int]:
        while self._due and self._due[0][0] <= now_ms:
            ready_ms, offset = heapq.heappop(self._due)
            if self._due_at.get(offset) != ready_ms or offset in self._leases:
                continue  # superseded, acked or leased meanwhile
            del self._due_at[offset]
            yield offset
        while self._next_new < self._end:
            offset = self._next_new
            self._next_new += 1
            if not self._is_done(offset) and offset not in self._leases:
                yield offset

    def _in_order(self, now_ms: int) -> Iterable[int]:
        """Exclusive mode: from the floor up, what is neither done nor leased; an offset
        nacked with a delay holds back everything after it (order first)."""
        offset = self._floor
        while offset < self._end:
            if not self._is_done(offset) and offset not in self._leases:
                if self._due_at.get(offset, now_ms) > now_ms:
                    return
                self._due_at.pop(offset, None)
                yield offset
            offset += 1

    def _lease(self, offset: int, consumer_id: str, now_ms: int) -> Delivery:
        deadline = now_ms + self.config.ack_deadline_ms
        self._leases[offset] = _Lease(consumer_id, deadline)
        if offset not in self._failures:
            # A redelivery (of a failure replicated from an earlier master) may lie above
            # offsets never handed out: those must not be skipped.
            self._next_new = max(self._next_new, offset + 1)
        attempt = self._failures.get(offset, 0) + 1
        return Delivery(offset, consumer_id, attempt, deadline, self._epoch)

    def _take_hold(self, consumer_id: str, now_ms: int) -> bool:
        if self._holder is None or self._holder == consumer_id:
            self._holder = consumer_id
            self._holder_seen_ms = now_ms
            return True
        return False
