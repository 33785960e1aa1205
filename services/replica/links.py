"""Topic link forwarding on the master: publishes a linked topic's events to its links.

Runs only while this replica is the master of an epoch whose start entry committed (the
node starts it then and stops it when the role goes), like push delivery
(`services/replica/push.py`). A supervisor keeps one worker per link in the store
(rescanning when a link is made or removed here, and every `_RESCAN_S`); each worker:

* resumes where the destination says: the link's forwarded events carry the publisher id
  `link_rules.link_publisher_id(created_lsn)` and sequence = source offset + 1, so that
  publisher's high-water mark on the destination, replicated with the events it covers,
  is the link's durable cursor (`link_rules.resume_offset`); no cursor entry of its own;
* reads committed events of the source (below the commit gate, as `Subscribe` does), at
  most `limits.push_batch_max_events` / `push_batch_max_bytes` at a time;
* keeps those the cost rules forward (`link_rules.plan_forward`) and publishes them to
  the destination through the log, one write at a time, so they keep the source's order.

A write that commits on the destination is deduplicated by sequence if a new master
offers it again, and one that did not commit is offered again: every event of the
source is stored once on the destination, in source order, whatever fails
(docs/federation.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from squall.v1 import common_pb2, replica_pb2
from squall_server.common.errors import ServiceError
from squall_server.replica import commands, link_rules
from squall_server.replica.store import StoreError, UnknownTopicError

if TYPE_CHECKING:
    from squall_server.replica.node import ReplicaNode

log = logging.getLogger("squall.replica.links")

# How often the supervisor rescans the store for links without being told.
_RESCAN_S = 1.0
# How long an idle worker waits for a commit before it rechecks its link.
_IDLE_RECHECK_S = 1.0
# How long a worker waits after a forwarding write failed (lost role, full store...).
_RETRY_S = 0.5

_LinkKey = tuple[str, str, int]  # source, destination, LSN of the link's entry


class LinkForwarding:
    """The master's link forwarding: a supervisor and one worker per link."""

    def __init__(self, node: ReplicaNode) -> None:
        self._node = node
        self._epoch = 0
        self._supervisor: asyncio.Task[None] | None = None
        self._workers: dict[_LinkKey, _Worker] = {}
        self._wake = asyncio.Event()

    def start(self, epoch: int) -> None:
        """Starts forwarding as the master of `epoch` (its start entry has committed)."""
        self.stop()
        self._epoch = epoch
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(epoch), name=f"links-{self._node.node.id}-{epoch}"
        )

    def stop(self) -> None:
        """Stops every worker now (the role is gone); a write in flight is cancelled."""
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
        for worker in self._workers.values():
            worker.task.cancel()
        self._workers.clear()

    async def close(self) -> None:
        """Stops and waits for the tasks to end."""
        tasks = [w.task for w in self._workers.values()]
        if self._supervisor is not None:
            tasks.append(self._supervisor)
        self.stop()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def refresh(self) -> None:
        """A link was made or removed here: rescan now."""
        self._wake.set()

    def active(self, epoch: int) -> bool:
        """Whether this replica still forwards as the master of `epoch`."""
        node = self._node
        return (
            self._supervisor is not None
            and self._epoch == epoch
            and node.role == common_pb2.ROLE_MASTER
            and node.epoch == epoch
            and not node.failed_reason
        )

    def position(self, link: replica_pb2.LinkTopicOp) -> int:
        """The next source offset the link examines, as this replica knows it."""
        key = (link.from_topic, link.to_topic, link.created_lsn)
        worker = self._workers.get(key)
        durable = link_rules.resume_offset(
            link.start_offset,
            self._node.store.publisher_high_water(link_rules.link_publisher_id(link.created_lsn)),
        )
        return durable if worker is None else max(durable, worker.position)

    async def _supervise(self, epoch: int) -> None:
        # Bounded per pass by the store's links; ends with the role.
        while self.active(epoch):
            self._wake.clear()
            try:
                links = self._node.store.list_links()
            except StoreError as exc:
                log.warning("replica %s: reading links failed: %s", self._node.node.id, exc)
                links = []
            wanted = {(x.from_topic, x.to_topic, x.created_lsn): x for x in links}
            for key in list(self._workers):
                worker = self._workers[key]
                if key not in wanted or worker.task.done():
                    worker.task.cancel()
                    del self._workers[key]
            for key, link in wanted.items():
                if key not in self._workers:
                    self._workers[key] = _Worker(self, link, epoch)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _RESCAN_S)


class _Worker:
    """Forwards one link's events while this replica is master."""

    def __init__(
        self, forwarding: LinkForwarding, link: replica_pb2.LinkTopicOp, epoch: int
    ) -> None:
        self._forwarding = forwarding
        self._node = forwarding._node
        self._link = link
        self._epoch = epoch
        self._publisher_id = link_rules.link_publisher_id(link.created_lsn)
        self.position = link.start_offset
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"link-{link.from_topic}-{link.to_topic}"
        )

    @property
    def _where(self) -> str:
        link = self._link
        return f"link '{link.from_topic}' -> '{link.to_topic}' (cost {link.cost})"

    def _linked(self) -> bool:
        return any(
            x.to_topic == self._link.to_topic and x.created_lsn == self._link.created_lsn
            for x in self._node.store.list_links(self._link.from_topic)
        )

    async def _run(self) -> None:
        try:
            await self._forward_loop()
        except asyncio.CancelledError:
            raise
        except StoreError as exc:
            # The supervisor starts a new worker at its next scan if still linked.
            log.warning(
                "replica %s: %s: forwarding stopped: %s", self._node.node.id, self._where, exc
            )

    async def _forward_loop(self) -> None:
        node, link = self._node, self._link
        topic = node.store.get_topic(link.from_topic)
        if topic is None:
            return
        limits = node.config.limits
        self.position = link_rules.resume_offset(
            link.start_offset, node.store.publisher_high_water(self._publisher_id)
        )
        log.info(
            "replica %s: %s: forwarding from offset %d (epoch=%d)",
            node.node.id,
            self._where,
            self.position,
            self._epoch,
        )
        # One read and at most one write per pass; ends with the role or the link.
        while self._forwarding.active(self._epoch):
            signal = node.commit_signal()
            if not self._linked():
                return
            hidden = node.visible_end(link.from_topic)
            events: list[common_pb2.Event] = []
            if not hidden or self.position < hidden:
                try:
                    events = node.store.read_events(
                        link.from_topic,
                        self.position,
                        min(limits.push_batch_max_events, limits.max_batch_events),
                        hidden,
                        max_bytes=min(limits.push_batch_max_bytes, limits.max_batch_bytes),
                        topic_id=topic.topic_id,
                    )
                except UnknownTopicError:
                    return  # destroyed meanwhile: its links went with it
            if not events:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IDLE_RECHECK_S):
                        await signal.wait()
                continue
            if events[0].offset > self.position:
                # Retention dropped them before the link got to them: say so, once.
                log.warning(
                    "replica %s: %s: offsets %d..%d were dropped by retention before they "
                    "were forwarded (epoch=%d)",
                    node.node.id,
                    self._where,
                    self.position,
                    events[0].offset - 1,
                    self._epoch,
                )
            plan = link_rules.plan_forward(events, link.cost)
            if plan.events:
                request = link_rules.publish_request(link.to_topic, link.created_lsn, plan)
                try:
                    await node.write(commands.Publish(request, forwarded=True))
                except ServiceError as exc:
                    # Lost the role, the destination is gone or full: read again from the
                    # same position (the sequences make a repeat harmless).
                    log.info(
                        "replica %s: %s: forwarding offsets %d..%d failed: %s",
                        node.node.id,
                        self._where,
                        self.position,
                        plan.next_offset - 1,
                        exc.message,
                    )
                    await asyncio.sleep(_RETRY_S)
                    continue
            self.position = plan.next_offset
