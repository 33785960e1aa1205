"""Topic links as readable transcripts: link-time refusals, IceStorm's cost and one-hop
rules, and exactly-once forwarding across a lost forwarder, on the real planning and
store code (``BatchBuilder`` over a memory ``Store``) with the forwarder's pure rules.

Each file under tests/unit/scenarios/links/ is a list of blocks in the format of
``tests/unit/transcripts.py``. After an intended change of behaviour, regenerate with
``SQUALL_REWRITE=1 .venv/bin/pytest tests/unit/test_link_scenarios.py`` and review the diff.

Commands (each one group commit of the master):
    create T [transient]          create a topic
    destroy T                     destroy a topic
    link A B COST                 TopicManager.LinkTopic
    unlink A B                    TopicManager.UnlinkTopic
    links A                       GetLinkInfo's records, as the store holds them
    publish T PAYLOAD[:COST] ...  an app's publish (no publisher id)
    publish-as ID T PAYLOAD ...   an app's publish under a publisher id
    forward [max=N]               every link's forwarder runs one step (reads at most N
                                  events), as links.py's worker does on the master
    new-master                    the forwarders' memory is lost (a failover): each
                                  resumes from what the store holds
    resend A B FIRST [max=N]      a deposed master's forwarder sends the events of A from
                                  FIRST again (as if its earlier write's outcome was lost)
    events T                      the topic's events: offset payload cost publisher
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from squall.v1 import broker_pb2, common_pb2, replica_pb2
from squall_server.common.config import LimitsConfig
from squall_server.common.errors import ServiceError
from squall_server.replica import commands, link_rules
from squall_server.replica.store import Store
from tests.unit.transcripts import check_or_rewrite, parse_transcript, render

SCENARIOS = sorted((Path(__file__).parent / "scenarios" / "links").glob("*.txt"))
LIMITS = LimitsConfig()


class Machine:
    """A master's store and its links' forwarders, stepped by hand."""

    def __init__(self) -> None:
        self.store = Store.open_memory()
        self.store.set_epoch(1)
        self.positions: dict[tuple[str, str, int], int] = {}  # the forwarders' memory

    def commit(self, command: commands.Command) -> commands.Planned:
        builder = commands.BatchBuilder(
            self.store,
            limits=LIMITS,
            node_id="n1",
            epoch=1,
            next_lsn=self.store.meta().last_lsn + 1,
            now_ms=1_000,
        )
        plan = builder.add(command)
        self.store.append(builder.entries, sync=False)
        return plan

    def position(self, link: replica_pb2.LinkTopicOp) -> int:
        key = (link.from_topic, link.to_topic, link.created_lsn)
        if key not in self.positions:
            high_water = self.store.publisher_high_water(
                link_rules.link_publisher_id(link.created_lsn)
            )
            self.positions[key] = link_rules.resume_offset(link.start_offset, high_water)
        return self.positions[key]

    def step(
        self, link: replica_pb2.LinkTopicOp, first: int, max_events: int, *, remember: bool = True
    ) -> str:
        events = self.store.read_events(link.from_topic, first, max_events)
        if not events:
            return f"{link.from_topic} -> {link.to_topic}: nothing from {first}"
        plan = link_rules.plan_forward(events, link.cost)
        line = (
            f"{link.from_topic} -> {link.to_topic}: examined {first}..{plan.next_offset - 1}, "
            f"sends {[e.payload.decode() for e in plan.events]}"
        )
        if plan.events:
            request = link_rules.publish_request(link.to_topic, link.created_lsn, plan)
            receipt = self.commit(commands.Publish(request, forwarded=True)).receipt
            assert receipt is not None
            line += f" stored {receipt.count - len(receipt.duplicates)}"
            if receipt.duplicates:
                line += f" duplicates {len(receipt.duplicates)}"
        if remember:
            self.positions[(link.from_topic, link.to_topic, link.created_lsn)] = plan.next_offset
        return line

    def run(self, command: str) -> list[str]:
        words = shlex.split(command)
        verb, args = words[0], words[1:]
        opts = dict(a.split("=", 1) for a in args if "=" in a)
        args = [a for a in args if "=" not in a]
        try:
            return self._run(verb, args, opts)
        except ServiceError as exc:
            return [f"error {exc.code.value}: {exc.message}"]

    def _run(self, verb: str, args: list[str], opts: dict[str, str]) -> list[str]:
        if verb == "create":
            kind = common_pb2.TOPIC_KIND_TRANSIENT if "transient" in args else 0
            self.commit(commands.CreateTopic(args[0], kind or common_pb2.TOPIC_KIND_REPLICATED))
            return ["ok"]
        if verb == "destroy":
            self.commit(commands.DestroyTopic(args[0]))
            return ["ok"]
        if verb == "link":
            plan = self.commit(commands.LinkTopic(args[0], args[1], int(args[2])))
            link = plan.link
            assert link is not None
            publisher_id = link_rules.link_publisher_id(link.created_lsn)
            return [
                f"linked {link.from_topic} -> {link.to_topic} cost {link.cost} "
                f"from offset {link.start_offset} as {publisher_id}"
            ]
        if verb == "unlink":
            self.commit(commands.UnlinkTopic(args[0], args[1]))
            return ["ok"]
        if verb == "links":
            links = self.store.list_links(args[0])
            return [
                f"{x.from_topic} -> {x.to_topic} cost {x.cost} next {self.position(x)}"
                for x in links
            ] or ["none"]
        if verb in ("publish", "publish-as"):
            publisher_id = args.pop(0) if verb == "publish-as" else ""
            topic, items = args[0], args[1:]
            events = []
            for item in items:
                payload, _, cost = item.partition(":")
                events.append(
                    common_pb2.EventData(
                        payload=payload.encode(),
                        cost=int(cost or 0),
                        sequence=len(events) + 1 if publisher_id else 0,
                    )
                )
            request = broker_pb2.PublishRequest(
                topic=topic, publisher_id=publisher_id, events=events
            )
            receipt = self.commit(commands.Publish(request)).receipt
            assert receipt is not None
            return [f"offsets {receipt.first_offset}..{receipt.first_offset + receipt.count - 1}"]
        if verb == "forward":
            max_events = int(opts.get("max", "100"))
            return [
                self.step(link, self.position(link), max_events) for link in self.store.list_links()
            ] or ["no links"]
        if verb == "new-master":
            self.positions.clear()
            return ["ok"]
        if verb == "resend":
            (link,) = [x for x in self.store.list_links(args[0]) if x.to_topic == args[1]]
            return [self.step(link, int(args[2]), int(opts.get("max", "100")), remember=False)]
        if verb == "events":
            return [
                f"{e.offset} {e.payload.decode()} cost={e.cost} {e.publisher_id or '-'}"
                for e in self.store.read_events(args[0], 0, 1000)
            ] or ["none"]
        raise ValueError(f"unknown command {verb!r}")


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_link_transcript(path: Path) -> None:
    text = path.read_text()
    blocks = parse_transcript(text)
    machine = Machine()
    outputs = [machine.run(block.command) for block in blocks]
    check_or_rewrite(path, text, render(blocks, outputs))


def test_links_and_the_forwarding_position_survive_a_restart(tmp_path: Path) -> None:
    """What a restarted replica (or a new master on it) finds in its LMDB store."""
    machine = Machine()
    machine.store.close()
    machine.store = Store.open_lmdb(tmp_path, 64 << 20)
    machine.store.set_epoch(1)
    for command in ("create a", "create b", "link a b 0", "publish a one two", "forward"):
        machine.run(command)
    before = machine.store.list_links()
    machine.store.close()
    again = Machine()
    again.store.close()
    again.store = Store.open_lmdb(tmp_path, 64 << 20)
    assert again.store.list_links() == before and len(before) == 1
    assert again.run("links a") == ["a -> b cost 0 next 2"]  # after 'two', from the store
    assert again.run("forward") == ["a -> b: nothing from 2"]
    again.store.close()
