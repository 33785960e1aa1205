"""The master's side of shared subscriptions: the driver around the pure core.

One `SharedSubscription` core per shared subscription (services/replica/shared.py), built
from the replicated state (`Store.get_shared`) the first time the master serves it and
rebuilt when the master's epoch or the cursor's seek generation changes: leases live only
here, so a new master delivers again whatever was not acknowledged. The core's decisions
become log entries in this order: a dead letter's publish to the dead-letter topic
(publisher id `dlq:<topic>:<subscription>`, sequence offset + 1, so a repeated one is
deduplicated), then the failure that marks the offset done; failures; acks. A background
tick (every `SHARED_TICK_MS`) turns lapsed leases into failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from squall.v1 import broker_pb2, common_pb2
from squall.wire.long_poll import PULL_WAIT_MAX_MS
from squall_server.common.errors import Code, ServiceError, not_found
from squall_server.replica import commands
from squall_server.replica.endpoints import SubscribeEndpoint
from squall_server.replica.shared import Changes, DeadLetter, Delivery, SharedConfig
from squall_server.replica.shared import SharedSubscription as Core
from squall_server.replica.store import SharedState

log = logging.getLogger("squall.replica")

# How often the master looks for lapsed leases (a lease lapses at most this late).
SHARED_TICK_MS = 100
# A Pull answers this long before its caller's deadline, so that its answer, and any
# event it leased, reach a caller still waiting (through the gateway too).
PULL_ANSWER_MARGIN_MS = 250
# Most offsets one consumer may hold at once (per-consumer flow control on the master).
OUTSTANDING_MAX = 1000
# Headers of a dead-lettered event.
DLQ_HEADER = "squall-dead-letter-"


@dataclass
class _Held:
    core: Core
    ident: tuple[int, int, int]  # topic id, seek generation, master epoch
    dead_letter_topic: str


class SharedMaster:
    """The shared subscriptions this master serves (see the module docstring)."""

    def __init__(self, node: SubscribeEndpoint) -> None:
        self.node = node
        self._held: dict[tuple[str, str], _Held] = {}
        self._ticker: asyncio.Task[None] | None = None

    # --- the cores

    def _state(self, topic: str, subscription: str) -> SharedState:
        state = self.node.store.get_shared(topic, subscription)
        if state is None:
            self.node.topic(topic)  # NOT_FOUND for the topic first
            raise not_found(
                f"shared subscription '{subscription}' on topic '{topic}' does not exist"
            )
        return state

    def held(self, topic: str, subscription: str) -> _Held:
        """The master's core of the subscription, built or rebuilt from the store."""
        self.node.check_writable()
        key = (topic, subscription)
        held = self._held.get(key)
        # The cheap check first (a topic and a cursor read); the full state only to build.
        info = self.node.store.get_topic(topic)
        cursor = self.node.store.get_cursor_state(topic, subscription)
        if info is None or cursor is None or held is None:
            now = None
        else:
            now = (info.topic_id, cursor[1], self.node.epoch)
        if held is None or held.ident != now:
            state = self._state(topic, subscription)
            ident = (state.topic_id, state.generation, self.node.epoch)
            settings = state.settings
            core = Core(
                SharedConfig(
                    ack_deadline_ms=settings.ack_deadline_ms,
                    max_deliveries=settings.max_deliveries,
                    outstanding_max=OUTSTANDING_MAX,
                    exclusive=settings.exclusive,
                    exclusive_takeover_ms=settings.exclusive_takeover_ms,
                ),
                epoch=self.node.epoch,
                floor=state.cursor,
                committed_end=self._end(topic),
                acked=state.done,
                failures=state.failures,
                last_errors=state.errors,
                acked_by=state.acked_by,
            )
            held = self._held[key] = _Held(core, ident, settings.dead_letter_topic)
            log.info(
                "node %s epoch %d: serving shared subscription '%s' on topic '%s' from "
                "cursor %d (%d failed offsets to deliver again)",
                self.node.node.id,
                self.node.epoch,
                subscription,
                topic,
                state.cursor,
                len(state.failures),
            )
        held.core.committed(self._end(topic))
        self._start_ticker()
        return held

    def outstanding(self, topic: str, subscription: str) -> int:
        """Offsets leased now (0 when this node does not serve the subscription)."""
        held = self._held.get((topic, subscription))
        if held is None or held.ident[2] != self.node.epoch:
            return 0
        return held.core.outstanding()

    def _end(self, topic: str) -> int:
        info = self.node.topic(topic)
        hidden = self.node.visible_end(topic)
        return info.next_offset if hidden is None else hidden

    # --- the calls

    async def pull(
        self,
        topic: str,
        subscription: str,
        consumer_id: str,
        max_messages: int,
        wait_ms: int,
        *,
        max_outstanding: int = 0,
        max_bytes: int = 0,
        deadline_in_ms: int | None = None,
    ) -> list[broker_pb2.SharedMessage]:
        """Leases events to the consumer, waiting up to wait_ms for one, within its flow
        control: max_outstanding leased to it in all, max_bytes in this answer. With the
        caller's deadline (deadline_in_ms from now) the wait ends PULL_ANSWER_MARGIN_MS
        before it, so the caller hears "nothing yet" rather than DEADLINE_EXCEEDED, which
        the gateway and the libraries would retry as if something had failed."""
        if not consumer_id:
            raise ServiceError(Code.INVALID_ARGUMENT, "pull needs a consumer_id")
        if max_messages < 1:
            raise ServiceError(
                Code.INVALID_ARGUMENT, f"max_messages must be >= 1, not {max_messages}"
            )
        clock = self.node.clock
        wait_ms = min(wait_ms, PULL_WAIT_MAX_MS)
        if deadline_in_ms is not None:
            wait_ms = min(wait_ms, max(0, deadline_in_ms - PULL_ANSWER_MARGIN_MS))
        give_up = clock.monotonic_ms() + wait_ms
        for _ in range(PULL_WAIT_MAX_MS // SHARED_TICK_MS + 2):  # bounded by give_up
            signal = self.node.commit_signal()
            held = self.held(topic, subscription)
            room = max_messages
            if max_outstanding:
                room = min(room, max_outstanding - held.core.outstanding(consumer_id))
            deliveries = held.core.pull(consumer_id, room, clock.monotonic_ms()) if room > 0 else []
            if deliveries:
                return self._messages(topic, held, deliveries, max_bytes)
            left = give_up - clock.monotonic_ms()
            if left <= 0:
                break
            # A commit brings new events; a tick brings redeliveries: wait for either.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, SHARED_TICK_MS) / 1000):
                    await signal.wait()
        return []

    def _messages(
        self, topic: str, held: _Held, deliveries: list[Delivery], max_bytes: int
    ) -> list[broker_pb2.SharedMessage]:
        out: list[broker_pb2.SharedMessage] = []
        lag = self.node.clock.wall_ms() - self.node.clock.monotonic_ms()
        size = 0
        for index, delivery in enumerate(deliveries):
            events = self.node.store.read_events(
                topic, delivery.offset, 1, delivery.offset + 1, topic_id=held.ident[0]
            )
            if not events:  # the offset was pruned: nothing to deliver, count it done
                held.core.ack(delivery.consumer_id, [delivery.offset], delivery.epoch)
                continue
            size += len(events[0].key) + len(events[0].payload)
            if max_bytes and out and size > max_bytes:
                rest = [d.offset for d in deliveries[index:]]
                held.core.release(delivery.consumer_id, rest)
                break
            out.append(
                broker_pb2.SharedMessage(
                    event=events[0],
                    delivery_attempt=delivery.attempt,
                    lease_epoch=delivery.epoch,
                    deadline_ms=delivery.deadline_ms + lag,
                )
            )
        return out

    async def ack(
        self, topic: str, subscription: str, consumer_id: str, offsets: list[int], epoch: int
    ) -> int:
        """Acknowledges offsets; the subscription's floor after it."""
        held = self.held(topic, subscription)
        changes = held.core.ack(consumer_id, offsets, epoch or self.node.epoch)
        try:
            await self._record(topic, subscription, held, changes, consumer_id)
        except BaseException:
            self._forget(topic, subscription, held)
            raise
        return held.core.floor

    async def nack(
        self,
        topic: str,
        subscription: str,
        consumer_id: str,
        offsets: list[int],
        epoch: int,
        *,
        delay_ms: int,
        error: str,
    ) -> int:
        """Gives offsets back; how many were dead-lettered."""
        held = self.held(topic, subscription)
        changes = held.core.nack(
            consumer_id,
            offsets,
            epoch or self.node.epoch,
            delay_ms=delay_ms,
            error=error or "nacked",
            now_ms=self.node.clock.monotonic_ms(),
        )
        try:
            await self._record(topic, subscription, held, changes)
        except BaseException:
            self._forget(topic, subscription, held)
            raise
        return len(changes.dead_letters)

    def extend(
        self,
        topic: str,
        subscription: str,
        consumer_id: str,
        offsets: list[int],
        epoch: int,
        extension_ms: int,
    ) -> int:
        """Extends leases (master memory only); the new deadline, wall clock ms."""
        held = self.held(topic, subscription)
        clock = self.node.clock
        deadline = held.core.extend(
            consumer_id,
            offsets,
            epoch or self.node.epoch,
            extension_ms=extension_ms,
            now_ms=clock.monotonic_ms(),
        )
        return deadline + clock.wall_ms() - clock.monotonic_ms()

    def _forget(self, topic: str, subscription: str, held: _Held) -> None:
        """Drops a core whose decisions did not all reach the log: the next call builds
        it again from what did (what was not recorded is delivered again)."""
        if self._held.get((topic, subscription)) is held:
            del self._held[(topic, subscription)]

    # --- what the core decided, written out

    async def _record(
        self,
        topic: str,
        subscription: str,
        held: _Held,
        changes: Changes,
        consumer_id: str = "",
    ) -> None:
        dead = {d.offset: d for d in changes.dead_letters}

        async def fail(offset: int, error: str) -> None:
            letter = dead.get(offset)
            if letter is not None:
                await self._dead_letter(topic, subscription, held, letter)
            await self.node.write(
                commands.SharedFail(topic, subscription, offset, error, letter is not None)
            )

        await asyncio.gather(*(fail(offset, error) for offset, error in changes.failed))
        if changes.acked:
            await self.node.write(
                commands.SharedAck(topic, subscription, tuple(changes.acked), consumer_id)
            )

    async def _dead_letter(
        self, topic: str, subscription: str, held: _Held, letter: DeadLetter
    ) -> None:
        target = held.dead_letter_topic
        if not target:
            log.warning(
                "node %s epoch %d: offset %d of topic '%s' failed %d deliveries on shared "
                "subscription '%s', which has no dead-letter topic: dropped (last error: %s)",
                self.node.node.id,
                self.node.epoch,
                letter.offset,
                topic,
                letter.deliveries,
                subscription,
                letter.last_error,
            )
            return
        events = self.node.store.read_events(
            topic, letter.offset, 1, letter.offset + 1, topic_id=held.ident[0]
        )
        if not events:
            return
        event = events[0]
        headers = dict(event.headers)
        headers.update(
            {
                DLQ_HEADER + "topic": topic,
                DLQ_HEADER + "offset": str(letter.offset),
                DLQ_HEADER + "subscription": subscription,
                DLQ_HEADER + "deliveries": str(letter.deliveries),
                DLQ_HEADER + "last-error": letter.last_error,
            }
        )
        request = broker_pb2.PublishRequest(
            topic=target,
            publisher_id=f"dlq:{topic}:{subscription}",
            events=[
                common_pb2.EventData(
                    key=event.key,
                    payload=event.payload,
                    sequence=letter.offset + 1,
                    headers=headers,
                )
            ],
        )
        await self.node.write(commands.Publish(request))
        log.info(
            "node %s epoch %d: offset %d of topic '%s' dead-lettered to '%s' after %d "
            "deliveries on shared subscription '%s' (last error: %s)",
            self.node.node.id,
            self.node.epoch,
            letter.offset,
            topic,
            target,
            letter.deliveries,
            subscription,
            letter.last_error,
        )

    # --- the deadline tick

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    async def _tick_loop(self) -> None:
        while self._held:
            await asyncio.sleep(SHARED_TICK_MS / 1000)
            await self.tick()

    async def tick(self) -> None:
        """Lapsed leases become failures (and dead letters); forgets cores of old epochs."""
        now = self.node.clock.monotonic_ms()
        for key, held in list(self._held.items()):
            if held.ident[2] != self.node.epoch or not self._is_master():
                del self._held[key]  # not this master's any more: leases are forgotten
                continue
            changes = held.core.tick(now)
            if not changes.failed:
                continue
            try:
                await self._record(key[0], key[1], held, changes)
            except ServiceError as exc:
                # The offsets are due again in this core; a master that lost its role
                # forgets them and the next one delivers them again.
                log.warning(
                    "node %s epoch %d: recording lapsed leases of shared subscription '%s' "
                    "on topic '%s' failed: %s",
                    self.node.node.id,
                    self.node.epoch,
                    key[1],
                    key[0],
                    exc.message,
                )
                self._forget(key[0], key[1], held)

    def _is_master(self) -> bool:
        return self.node.role == common_pb2.ROLE_MASTER
