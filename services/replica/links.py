"""Topic link forwarding on the master: publishes a linked topic's events to its links.

Runs only while this replica is the master of an epoch whose start entry committed (the
node starts it then and stops it when the role goes), like push delivery
(`services/replica/push.py`); both share that lifecycle (`master_tasks.MasterTasks`). A
supervisor keeps one worker per link in the store (rescanning when a link is made or
removed here, and every `_RESCAN_S`); each worker:

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

import grpc

from squall.v1 import broker_pb2_grpc, common_pb2, replica_pb2
from squall_server.common.config import RemoteConfig
from squall_server.common.errors import ServiceError
from squall_server.replica import commands, link_rules, remote
from squall_server.replica.master_tasks import MasterTasks
from squall_server.replica.store import StoreError, UnknownTopicError

if TYPE_CHECKING:
    from squall_server.replica.endpoints import ForwardingEndpoint

log = logging.getLogger("squall.replica.links")

# How often the supervisor rescans the store for links without being told.
_RESCAN_S = 1.0
# How long an idle worker waits for a commit before it rechecks its link.
_IDLE_RECHECK_S = 1.0
# How long a worker waits after a forwarding write failed (lost role, full store...).
_RETRY_S = 0.5
# A link to another cluster that cannot reach it waits this long after the first failed
# call, doubling up to the cap (its source's publishers never wait for it).
_REMOTE_RETRY_INITIAL_S = 0.2
_REMOTE_RETRY_MAX_S = 5.0
# A remote link's cursor write rides with the master's next commit batch (its source's
# publishes), alone only after this long without one: under traffic a forwarded batch
# costs no commit round of its own here. A new master offers again at most what this
# window held; the other side answers those as duplicates.
_CURSOR_RIDE_S = 0.05
# What another cluster answers when it will never take a batch (the destination topic is
# gone, an event breaks its limits, the token's principal lacks a permission): the link
# stops there, with the reason in GetLinkInfo and an ERROR log line, instead of offering
# it again for ever. Everything else (unreachable, no master, full, an unknown token,
# which a rotated token file fixes) is retried with backoff.
REFUSED_FOR_GOOD = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
    }
)

_LinkKey = tuple[str, str, int]  # source, destination, LSN of the link's entry


def _key(link: replica_pb2.LinkTopicOp) -> _LinkKey:
    target = link_rules.link_target(link.to_cluster, link.to_topic)
    return (link.from_topic, target, link.created_lsn)


def _remote_where(link: replica_pb2.LinkTopicOp) -> str:
    return (
        f"link '{link.from_topic}' -> '{link.to_topic}' on cluster '{link.to_cluster}' "
        f"(cost {link.cost})"
    )


class LinkForwarding(
    MasterTasks[_LinkKey, replica_pb2.LinkTopicOp, "_Worker | _RemoteWorker", "ForwardingEndpoint"]
):
    """The master's link forwarding: a supervisor and one worker per link (the lifecycle,
    `start`/`stop`/`close`/`refresh`/`active`, is `MasterTasks`', shared with push)."""

    def __init__(self, node: ForwardingEndpoint) -> None:
        super().__init__(node, "link forwarding", log)

    def rescan_s(self) -> float:
        return _RESCAN_S

    def wanted(self) -> dict[_LinkKey, replica_pb2.LinkTopicOp]:
        return {_key(x): x for x in self._node.store.list_links()}

    def make(
        self, key: _LinkKey, item: replica_pb2.LinkTopicOp, epoch: int
    ) -> _Worker | _RemoteWorker | None:
        if not item.to_cluster:
            return _Worker(self, item, epoch)
        config = self._node.config.remote(item.to_cluster)
        if config is None:
            log.warning(
                "replica %s: link '%s' -> '%s': no [[remotes]] entry named '%s' in "
                "this node's file; not forwarding",
                self._node.node.id,
                item.from_topic,
                item.to_topic,
                item.to_cluster,
            )
            return None
        return _RemoteWorker(self, item, config, epoch)

    def restart(self, worker: _Worker | _RemoteWorker) -> bool:
        # A link stopped for good stays stopped while this replica is master.
        return not worker.stopped_reason

    def position(self, link: replica_pb2.LinkTopicOp) -> int:
        """The next source offset the link examines, as this replica knows it."""
        worker = self._workers.get(_key(link))
        if link.to_cluster:
            durable = max(link.start_offset, link.cursor)
            return durable if worker is None else max(durable, worker.position)
        durable = link_rules.resume_offset(
            link.start_offset,
            self._node.store.publisher_high_water(link_rules.link_publisher_id(link.created_lsn)),
        )
        return durable if worker is None else max(durable, worker.position)

    def stopped_reason(self, link: replica_pb2.LinkTopicOp) -> str:
        """Why the link's forwarding stopped on this master ("" while it goes on)."""
        worker = self._workers.get(_key(link))
        return "" if worker is None else worker.stopped_reason

    async def retry(self, link: replica_pb2.LinkTopicOp) -> str:
        """Forwards a link stopped by a refusal for good again (`RetryLink`), from its
        committed cursor; returns the reason it had stopped ("": it was not stopped, and
        nothing changes). The stopped worker's last cursor write is awaited first, so the
        new worker starts after every batch the remote acknowledged."""
        key = _key(link)
        worker = self._workers.get(key)
        if worker is None or not worker.stopped_reason:
            return ""
        reason = worker.stopped_reason
        # Not cancelled with the call: the stop's cursor write is the log's, not the caller's.
        await asyncio.wait([worker.task])
        if self._workers.get(key) is worker:
            del self._workers[key]
            self.refresh()
        log.warning(
            "replica %s: %s: forwarding again from offset %d at the operator's request "
            "(epoch=%d); it had %s",
            self._node.node.id,
            _remote_where(link),
            self.position(link),
            self._node.epoch,
            reason,
        )
        return reason

    def lag(self, link: replica_pb2.LinkTopicOp) -> tuple[int, int, int]:
        """(next offset, events waiting, ms the oldest of them has waited) of a link."""
        node = self._node
        position = self.position(link)
        source = node.store.get_topic(link.from_topic)
        end = 0 if source is None else source.next_offset
        lag_ms = 0
        if source is not None and position < end:
            waiting = node.store.read_events(link.from_topic, position, 1)
            if waiting:
                lag_ms = max(0, node.clock.wall_ms() - waiting[0].timestamp_ms)
        return position, max(0, end - position), lag_ms

    def lags(self) -> list[tuple[str, str, int, int]]:
        """(source, destination, events waiting, ms) of every link, while forwarding."""
        if not self.running:
            return []
        out = []
        for link in self._node.store.list_links():
            _, events, lag_ms = self.lag(link)
            target = link_rules.link_target(link.to_cluster, link.to_topic)
            out.append((link.from_topic, target, events, lag_ms))
        return out


class _Worker:
    """Forwards one link's events while this replica is master."""

    stopped_reason = ""  # a link within the cluster is never refused for good

    def cancel(self) -> None:
        self.task.cancel()

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
            events = await _next_events(node, link, topic.topic_id, self.position, signal)
            if events is None:
                return  # destroyed meanwhile: its links went with it
            if not events:
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


class _RemoteWorker:
    """Forwards one link to another cluster's gateways while this replica is master.

    Its cursor is in the link's record here (the other cluster's dedupe state is not in
    this store): after the other side acknowledged a batch, the cursor moves through the
    log, at most one write in flight, each carrying the newest position. A new master
    resumes at the cursor and offers again what was acknowledged after it; the other side
    answers those as duplicates (same publisher id, sequence = source offset + 1). The
    write rides with the next commit batch (``_CURSOR_RIDE_S``).
    """

    def __init__(
        self,
        forwarding: LinkForwarding,
        link: replica_pb2.LinkTopicOp,
        config: RemoteConfig,
        epoch: int,
    ) -> None:
        self._forwarding = forwarding
        self._node = forwarding._node
        self._link = link
        self._remote = config
        self._epoch = epoch
        self.position = max(link.start_offset, link.cursor)
        self._durable = self.position  # the cursor the log holds (or will)
        self._cursor_task: asyncio.Task[None] | None = None
        self.failures = 0
        self.last_error = ""
        self.stopped_reason = ""
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"link-{link.from_topic}-{link.to_topic}@{link.to_cluster}"
        )

    def cancel(self) -> None:
        self.task.cancel()
        if self._cursor_task is not None:
            self._cursor_task.cancel()

    @property
    def _where(self) -> str:
        return _remote_where(self._link)

    def _linked(self) -> bool:
        return any(
            x.to_topic == self._link.to_topic
            and x.to_cluster == self._link.to_cluster
            and x.created_lsn == self._link.created_lsn
            for x in self._node.store.list_links(self._link.from_topic)
        )

    async def _run(self) -> None:
        node = self._node
        try:
            channel = remote.remote_channel(self._remote, node.config.limits.max_message_bytes)
        except OSError as exc:  # the CA file: the supervisor retries at its next scan
            log.warning(
                "replica %s: %s: cannot reach the remote: %s", node.node.id, self._where, exc
            )
            return
        try:
            await self._forward_loop(broker_pb2_grpc.PublisherStub(channel))
        except asyncio.CancelledError:
            raise
        except StoreError as exc:
            log.warning("replica %s: %s: forwarding stopped: %s", node.node.id, self._where, exc)
        finally:
            if self._cursor_task is not None:
                self._cursor_task.cancel()
            await channel.close(None)

    async def _forward_loop(self, stub: broker_pb2_grpc.PublisherAsyncStub) -> None:
        node, link = self._node, self._link
        topic = node.store.get_topic(link.from_topic)
        if topic is None:
            return
        source_cluster = node.config.name
        log.info(
            "replica %s: %s: forwarding from offset %d (epoch=%d)",
            node.node.id,
            self._where,
            self.position,
            self._epoch,
        )
        # One read and at most one call per pass; ends with the role or the link.
        while self._forwarding.active(self._epoch):
            signal = node.commit_signal()
            if not self._linked():
                return
            events = await _next_events(node, link, topic.topic_id, self.position, signal)
            if events is None:
                return  # destroyed meanwhile: its links went with it
            if not events:
                continue
            plan = link_rules.plan_forward(events, link.cost)
            if plan.events:
                request = link_rules.publish_request(
                    link.to_topic, link.created_lsn, plan, source_cluster
                )
                try:
                    metadata = remote.remote_metadata(self._remote)
                    await stub.Publish(
                        request,
                        timeout=remote.REMOTE_CALL_TIMEOUT_MS / 1000,
                        metadata=metadata or None,
                    )
                except (grpc.aio.AioRpcError, OSError, ValueError) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in REFUSED_FOR_GOOD:
                        await self._stop(exc, plan.next_offset)
                        return
                    await self._failed(exc, plan.next_offset)
                    continue
            if self.failures:
                log.info(
                    "replica %s: %s: the other cluster answers again after %d failed calls",
                    node.node.id,
                    self._where,
                    self.failures,
                )
            self.failures, self.last_error = 0, ""
            self.position = plan.next_offset
            self._advance()

    async def _stop(self, exc: grpc.aio.AioRpcError, end: int) -> None:
        """The other cluster refused a batch for good: forwarding stops here, says why."""
        error = remote.remote_error(self._remote, exc, "store forwarded events")
        self.stopped_reason = (
            f"stopped at offset {self.position} (offsets {self.position}..{end - 1} refused "
            f"for good, not retried): {error.message}; fix the cause, then retry the link "
            "(`squall topic retry-link`) to forward from there"
        )
        log.error(
            "replica %s: %s: forwarding stopped (epoch=%d): %s",
            self._node.node.id,
            self._where,
            self._epoch,
            self.stopped_reason,
        )
        if self._cursor_task is not None:  # what was acknowledged before stays acknowledged
            await self._cursor_task

    async def _failed(self, exc: Exception, end: int) -> None:
        """Logs a failed call (a warning the first time) and waits before the next."""
        self.failures += 1
        if isinstance(exc, grpc.aio.AioRpcError):
            error = remote.remote_error(self._remote, exc, "store forwarded events")
            self.last_error = error.message
        else:
            self.last_error = f"cannot read the token for '{self._remote.name}': {exc}"
        log.log(
            logging.WARNING if self.failures == 1 else logging.DEBUG,
            "replica %s: %s: forwarding offsets %d..%d failed (%d in a row): %s",
            self._node.node.id,
            self._where,
            self.position,
            end - 1,
            self.failures,
            self.last_error,
        )
        delay_s = min(_REMOTE_RETRY_MAX_S, _REMOTE_RETRY_INITIAL_S * 2 ** (self.failures - 1))
        await asyncio.sleep(delay_s)

    def _advance(self) -> None:
        if self._cursor_task is None or self._cursor_task.done():
            self._cursor_task = asyncio.get_running_loop().create_task(self._write_cursor())

    async def _write_cursor(self) -> None:
        """Writes the newest position until the log holds it; one write at a time."""
        node, link = self._node, self._link
        # Each pass writes a newer cursor than the last: bounded by the batches forwarded.
        while self.position > self._durable and self._forwarding.active(self._epoch):
            target = self.position
            try:
                await node.write_with_next(
                    commands.LinkCursor(
                        link.from_topic, link.to_cluster, link.to_topic, link.created_lsn, target
                    ),
                    _CURSOR_RIDE_S,
                )
            except ServiceError as exc:
                log.debug(
                    "replica %s: %s: cursor %d not written: %s",
                    node.node.id,
                    self._where,
                    target,
                    exc.message,
                )
                return
            self._durable = max(self._durable, target)


async def _next_events(
    node: ForwardingEndpoint,
    link: replica_pb2.LinkTopicOp,
    topic_id: int,
    position: int,
    signal: asyncio.Event,
) -> list[common_pb2.Event] | None:
    """The committed events of the link's source from ``position`` on, one batch; empty
    after waiting (at most _IDLE_RECHECK_S) for a commit when there are none yet; None when
    the source topic is gone. Shared by the in-cluster and the remote forwarder."""
    limits = node.config.limits
    hidden = node.visible_end(link.from_topic)
    events: list[common_pb2.Event] = []
    if hidden is None or position < hidden:
        try:
            events = node.store.read_events(
                link.from_topic,
                position,
                min(limits.push_batch_max_events, limits.max_batch_events),
                hidden or 0,
                max_bytes=min(limits.push_batch_max_bytes, limits.max_batch_bytes),
                topic_id=topic_id,
            )
        except UnknownTopicError:
            return None
    if not events:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_IDLE_RECHECK_S):
                await signal.wait()
    return events
