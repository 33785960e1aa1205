"""The `squall` command: start a service, or talk to a cluster through a gateway.

    squall replica --config F --node N          start a service (each is its own process)
    squall coordinator --config F --node N
    squall gateway --config F [--gateway ID]
    squall topic create NAME [--transient]      client commands, through a gateway
    squall topic list [--json] | topic destroy NAME
    squall topic subscribers NAME [--json] | topic unsubscribe NAME ID     push subscribers
    squall topic link NAME TO [--cost N] [--cluster R] | topic unlink NAME TO [--cluster R]
    squall topic retry-link NAME TO [--cluster R]
    squall topic links [NAME] [--json] | topic info NAME [--json]   links and where they are
    squall publish TOPIC [MESSAGE ...]          no MESSAGE: one event per line of stdin
    squall subscribe TOPIC [--subscription S] [--from earliest|latest|N|ISO8601] [--follow]
                     [--count N] [--read-from master|replicas]
    squall subscribe TOPIC --shared S [--consumer ID] [--follow] [--count N]
                     [--ack-deadline-ms MS] [--max-deliveries N] [--dead-letter-topic T]
                     [--exclusive]
                                                one of S's competing consumers (created
                                                with those settings if it does not exist)
    squall subscription seek TOPIC S (--time ISO8601 | --offset N | --earliest | --latest)
    squall subscription info TOPIC S [--json]   a durable subscription's cursor and backlog
    squall status [--json] [--explain] [--wait-normal SECONDS]
                                                --explain: why the master leads, who would
                                                lead if a node failed
    squall cluster shutdown | quorum-override N | designated-primary NODE | transfer ...
                                                operator controls (services/cli/admin.py)
    squall store inspect DIR | mark-clean DIR | mark-dirty DIR   a stopped node's store
    squall store backup DATA_DIR DEST           a live store's verified copy (store restore: back)
    squall store verify BACKUP                  read a backup back in full (progress on stderr)
    squall health ADDRESS                       exit 0 if the service there is SERVING
    squall config check FILE [--node ID]        validate a cluster file as the services do
    squall completion bash|zsh                  a shell completion script (docs/operations.md)
    squall console [--listen HOST:PORT]         serve the web console (docs/console.md)

Client commands find the gateway from --gateway, else the first gateway of --config, else
$SQUALL_GATEWAY, else 127.0.0.1:7100 (the shipped configs' gateway). Errors print one
line, `squall: <error>`, on stderr; the exit status is 1 for a failed call and 2 for a
usage or configuration error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import TextIO

import squall
from squall_server.cli import admin as cli_admin
from squall_server.cli import auth as cli_auth
from squall_server.cli import certs as cli_certs
from squall_server.cli import completion as cli_completion
from squall_server.cli import config as cli_config
from squall_server.cli import console as cli_console
from squall_server.cli import explain as cli_explain
from squall_server.cli import health as cli_health
from squall_server.cli import listing as cli_listing
from squall_server.cli import status_wait as cli_status_wait
from squall_server.cli import store as cli_store
from squall_server.cli import store_backup as cli_store_backup
from squall_server.cli import subscription as cli_subscription

# The gateway address deploy/single.toml and deploy/cluster.example.toml give (`make run`).
DEFAULT_GATEWAY = "127.0.0.1:7100"
GATEWAY_ENV = "SQUALL_GATEWAY"
SERVICE_MODULES = {
    "replica": "squall_server.replica.__main__",
    "coordinator": "squall_server.coordinator.__main__",
    "gateway": "squall_server.gateway.__main__",
}


class UsageError(Exception):
    """A bad command line or configuration file: exit status 2."""


# -- argument parsing -------------------------------------------------------------------


def _start(value: str) -> squall.SeekTarget:
    if value == "earliest":
        return "earliest"
    if value == "latest":
        return "latest"
    if "T" in value or "t" in value:  # an ISO 8601 time: the first event at or after it
        return cli_subscription.parse_time(value)
    if not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(
            f"must be earliest, latest, an offset or an ISO 8601 time, not {value!r}"
        )
    return cli_subscription.parse_offset(value)


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {number}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, for parsing and for --help."""
    parser = argparse.ArgumentParser(
        prog="squall", description="Squall: a highly available, durable publish/subscribe service."
    )
    parser.add_argument("--version", action="version", version=f"squall {squall.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name, help_text in (
        ("replica", "run a node's replica (LMDB store, serves topics)"),
        ("coordinator", "run a node's coordinator (election and membership)"),
    ):
        service = commands.add_parser(name, help=help_text)
        service.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
        service.add_argument("--node", required=True, metavar="ID", help="this node's id")
    gateway = commands.add_parser("gateway", help="run a gateway (the apps' endpoint)")
    gateway.add_argument("--config", required=True, metavar="FILE", help="cluster TOML file")
    gateway.add_argument("--gateway", metavar="ID", help="which configured gateway to run")

    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--gateway",
        metavar="ADDR",
        help=f"gateway host:port (default: --config's first gateway, ${GATEWAY_ENV}, "
        f"{DEFAULT_GATEWAY})",
    )
    client.add_argument("--config", metavar="FILE", help="cluster TOML file to find the gateway")
    cli_auth.add_token_argument(client)
    client.add_argument(
        "--timeout", type=_positive_float, default=10.0, metavar="SECONDS", help="per-call deadline"
    )

    topic = commands.add_parser("topic", help="create, list or destroy topics")
    topic_commands = topic.add_subparsers(dest="topic_command", required=True, metavar="ACTION")
    create = topic_commands.add_parser("create", parents=[client], help="create a topic")
    create.add_argument("name")
    create.add_argument(
        "--transient", action="store_true", help="deliver live only, do not store events"
    )
    cli_listing.add_json_flag(
        topic_commands.add_parser("list", parents=[client], help="list topics")
    )
    destroy = topic_commands.add_parser(
        "destroy", parents=[client], help="destroy a topic, its events and subscriptions"
    )
    destroy.add_argument("name")
    subscribers = topic_commands.add_parser(
        "subscribers", parents=[client], help="list a topic's push subscribers"
    )
    subscribers.add_argument("name")
    cli_listing.add_json_flag(subscribers)
    unsubscribe = topic_commands.add_parser(
        "unsubscribe", parents=[client], help="remove a push subscriber"
    )
    unsubscribe.add_argument("name")
    unsubscribe.add_argument("subscriber_id")

    link = topic_commands.add_parser(
        "link",
        parents=[client],
        help="forward a topic's new events to another topic (IceStorm's link)",
    )
    link.add_argument("name")
    link.add_argument("to")
    link.add_argument(
        "--cost",
        type=int,
        default=0,
        metavar="N",
        help="0 forwards every event; N > 0 only events of cost at most N",
    )
    unlink = topic_commands.add_parser("unlink", parents=[client], help="remove a topic link")
    unlink.add_argument("name")
    unlink.add_argument("to")
    retry_link = topic_commands.add_parser(
        "retry-link",
        parents=[client],
        help="forward again a link that another cluster's refusal stopped (fix the cause first)",
    )
    retry_link.add_argument("name")
    retry_link.add_argument("to")
    for link_parser in (link, unlink, retry_link):
        link_parser.add_argument(
            "--cluster",
            default="",
            metavar="REMOTE",
            help="TO is a topic of another cluster (a [[remotes]] name of the cluster file)",
        )
    links = topic_commands.add_parser(
        "links", parents=[client], help="a topic's links (every link without NAME)"
    )
    links.add_argument("name", nargs="?", default="")
    cli_listing.add_json_flag(links)
    info = topic_commands.add_parser("info", parents=[client], help="a topic and its links")
    info.add_argument("name")
    cli_listing.add_json_flag(info)

    publish = commands.add_parser(
        "publish", parents=[client], help="publish messages (or stdin lines) to a topic"
    )
    publish.add_argument("topic")
    publish.add_argument("messages", nargs="*", metavar="MESSAGE")
    publish.add_argument("--key", help="key for every event (UTF-8)")
    publish.add_argument(
        "--publisher-id", metavar="ID", help="publisher id for deduplication (default: random)"
    )
    publish.add_argument(
        "--start-sequence",
        type=_positive_int,
        default=1,
        metavar="N",
        help="first sequence number (to resume a known publisher id)",
    )

    subscribe = commands.add_parser("subscribe", parents=[client], help="print a topic's events")
    subscribe.add_argument("topic")
    subscribe.add_argument("--subscription", metavar="NAME", help="durable subscription (acked)")
    subscribe.add_argument(
        "--from",
        dest="start",
        type=_start,
        default="earliest",
        metavar="earliest|latest|N|TIME",
        help="where to start without a cursor: TIME (ISO 8601 with a timezone) means the "
        "first event published at or after it (default: earliest)",
    )
    subscribe.add_argument(
        "--follow", action="store_true", help="keep waiting for new events (Ctrl-C stops)"
    )
    subscribe.add_argument("--count", type=_positive_int, metavar="N", help="stop after N events")
    subscribe.add_argument(
        "--read-from",
        choices=("master", "replicas"),
        default=None,
        help="which replicas the gateway may read from (default: the gateway's read_from "
        "setting); replicas serve committed events only",
    )
    subscribe.add_argument(
        "--shared",
        metavar="NAME",
        help="consume a shared subscription (each event to one of its consumers, acked one "
        "by one); created with the settings below if it does not exist",
    )
    subscribe.add_argument("--consumer", metavar="ID", help="--shared: this consumer's id")
    subscribe.add_argument(
        "--ack-deadline-ms", type=_positive_int, default=30_000, metavar="MS",
        help="--shared, on creation: redeliver an event not acked within MS (default 30000)",
    )  # fmt: skip
    subscribe.add_argument(
        "--max-deliveries", type=_positive_int, default=5, metavar="N",
        help="--shared, on creation: dead-letter an event after N failed deliveries (default 5)",
    )  # fmt: skip
    subscribe.add_argument(
        "--exclusive",
        action="store_true",
        help="--shared, on creation: one consumer at a time, in offset order",
    )
    subscribe.add_argument(
        "--dead-letter-topic", default="", metavar="TOPIC",
        help="--shared, on creation: where dead-lettered events are published",
    )  # fmt: skip

    status = commands.add_parser("status", parents=[client], help="the cluster's replica table")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument(
        "--wait-normal",
        type=_positive_float,
        metavar="SECONDS",
        help="first wait until every node is normal in one group and caught up (exit 1 if not)",
    )
    status.add_argument(
        "--max-lag",
        type=_positive_int,
        default=cli_status_wait.DEFAULT_MAX_LAG_ENTRIES,
        metavar="ENTRIES",
        help="with --wait-normal: most entries a slave may lag (default: %(default)s)",
    )
    status.add_argument(
        "--explain",
        action="store_true",
        help="also say why the master leads and who would lead if each node failed",
    )

    cli_subscription.add_parser(commands, client)
    cli_console.add_parser(commands, client)
    cli_admin.add_parser(commands)
    cli_store.add_parser(commands)
    cli_store_backup.add_parser(commands)
    cli_health.add_parser(commands)
    cli_certs.add_parser(commands)
    cli_auth.add_parser(commands)
    cli_config.add_parser(commands)
    cli_completion.add_parser(commands)
    return parser


# -- finding the gateway ----------------------------------------------------------------


def gateway_from_config(path: str) -> str:
    """The first gateway address in a cluster configuration file (UsageError if unusable)."""
    # Imported here: service start-up and client commands that do not read a config
    # should not pay for it.
    from squall_server.common.config import ConfigError, load_config

    try:
        return load_config(path).gateway().address
    except ConfigError as err:
        raise UsageError(f"config error: {path}: {' '.join(err.message.splitlines())}") from None


def resolve_gateway(args: argparse.Namespace) -> str:
    """--gateway, else --config's first gateway, else $SQUALL_GATEWAY, else the default.

    An explicit --config wins over the environment: a flag on this command line is a
    stronger statement than a variable left in the shell.
    """
    if args.gateway:
        return str(args.gateway)
    if args.config:
        return gateway_from_config(args.config)
    return os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY


def tls_from_config(args: argparse.Namespace, address: str) -> squall.TlsOptions | None:
    """TLS options from --config's [tls] (the admin certificate when cert_dir has one)."""
    if not args.config:
        return None
    from squall_server.common.config import ConfigError, load_config
    from squall_server.common.tls import ADMIN_ID, address_owner, cli_identity

    try:
        config = load_config(args.config)
    except ConfigError as err:
        message = " ".join(err.message.splitlines())
        raise UsageError(f"config error: {args.config}: {message}") from None
    tls = config.tls
    if not tls.enabled or tls.ca_file is None or tls.cert_dir is None:
        return None
    admin = cli_identity(config) == ADMIN_ID
    return squall.TlsOptions(
        ca_file=tls.ca_file,
        cert_file=tls.cert_dir / f"{ADMIN_ID}.crt" if admin else None,
        key_file=tls.cert_dir / f"{ADMIN_ID}.key" if admin else None,
        server_name=address_owner(config, address),
    )


# -- client commands --------------------------------------------------------------------


def _escape(data: bytes) -> str:
    """Bytes as one printable line: UTF-8 text, with backslash escapes for the rest.

    Backslashes are doubled first, so an escape in the output always means an escaped
    byte or control character, never a literal backslash in the data.
    """
    text = data.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")
    return text.translate(_CONTROL_ESCAPES)


_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {
    ord("\t"): "\\t",
    ord("\n"): "\\n",
    ord("\r"): "\\r",
}


def _receipt_line(receipt: squall.Receipt) -> str:
    line = f"offset={receipt.offset} lsn={receipt.lsn} epoch={receipt.epoch}"
    return line + " duplicate=true" if receipt.duplicate else line


def _stdin_lines(stdin: TextIO) -> Iterator[bytes]:
    source = getattr(stdin, "buffer", None)
    if source is None:
        for text in stdin:
            yield text.rstrip("\r\n").encode("utf-8")
        return
    for line in source:
        yield line.rstrip(b"\r\n")


def _cmd_topic(client: squall.Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.topic_command == "create":
        info = client.create_topic(args.name, kind="transient" if args.transient else "replicated")
        print(f"created {info.kind} topic {info.name}", file=out)
    elif args.topic_command == "list" and args.json:
        cli_listing.print_json(cli_listing.topics_document(client.topics()), out)
    elif args.topic_command == "subscribers" and args.json:
        subscribers = client.topic(args.name).push_subscribers()
        cli_listing.print_json(cli_listing.subscribers_document(args.name, subscribers), out)
    elif args.topic_command == "list":
        for info in client.topics():
            print(
                f"{info.name}\t{info.kind}\tfirst_offset={info.first_offset}"
                f"\tnext_offset={info.next_offset}\tsize_bytes={cli_listing.size_text(info)}",
                file=out,
            )
    elif args.topic_command == "subscribers":
        for sub in client.topic(args.name).push_subscribers():
            print(
                f"{sub.subscriber_id}\t{sub.endpoint}\treliability={sub.qos.get('reliability', '')}"
                f"\tretryCount={sub.retry_count}\tcursor={sub.cursor}"
                f"\tfailures={sub.consecutive_failures}"
                + (f"\tlast_error={sub.last_error}" if sub.last_error else ""),
                file=out,
            )
    elif args.topic_command in ("link", "unlink", "retry-link", "links", "info"):
        return _cmd_topic_links(client, args, out)
    elif args.topic_command == "unsubscribe":
        client.topic(args.name).unsubscribe_push(args.subscriber_id)
        print(f"unsubscribed {args.subscriber_id} from topic {args.name}", file=out)
    else:
        client.destroy_topic(args.name)
        print(f"destroyed topic {args.name}", file=out)
    return 0


def _cmd_topic_links(client: squall.Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.topic_command == "link":
        link = client.topic(args.name).link(args.to, cost=args.cost, cluster=args.cluster)
        target = f"{link.to_topic}@{link.to_cluster}" if link.to_cluster else link.to_topic
        print(
            f"linked topic {link.from_topic} to {target} with cost {link.cost} "
            f"(forwarding from offset {link.start_offset} as {link.publisher_id})",
            file=out,
        )
    elif args.topic_command == "unlink":
        client.topic(args.name).unlink(args.to, cluster=args.cluster)
        target = f"{args.to}@{args.cluster}" if args.cluster else args.to
        print(f"unlinked topic {args.name} from {target}", file=out)
    elif args.topic_command == "retry-link":
        link, was_stopped = client.topic(args.name).retry_link(args.to, cluster=args.cluster)
        target = f"{link.to_topic}@{link.to_cluster}" if link.to_cluster else link.to_topic
        print(
            f"link {link.from_topic} -> {target}: "
            + (
                f"forwarding again from offset {link.next_offset}"
                if was_stopped
                else f"was not stopped; it forwards from offset {link.next_offset}"
            ),
            file=out,
        )
    elif args.topic_command == "links":
        links = client.topic(args.name).links() if args.name else client.links()
        if args.json:
            cli_listing.print_json(cli_listing.links_document(links), out)
        for line in [] if args.json else cli_listing.link_lines(links):
            print(line, file=out)
    else:
        topic = client.topic(args.name)
        links = topic.links()
        if args.json:
            document = dataclasses.asdict(topic.info)
            document.update(cli_listing.links_document(links))
            cli_listing.print_json(document, out)
            return 0
        info = topic.info
        print(
            f"{info.name}\t{info.kind}\tfirst_offset={info.first_offset}"
            f"\tnext_offset={info.next_offset}\tsize_bytes={cli_listing.size_text(info)}"
            f"\tlinks={len(links)}",
            file=out,
        )
        for line in cli_listing.link_lines(links):
            print(f"  {line}", file=out)
    return 0


def _cmd_publish(
    client: squall.Client, args: argparse.Namespace, out: TextIO, stdin: TextIO
) -> int:
    key = args.key.encode("utf-8") if args.key is not None else None
    topic = client.topic(args.topic)
    with topic.publisher(args.publisher_id, start_sequence=args.start_sequence) as publisher:
        if args.messages:
            events = [(key, message.encode("utf-8")) for message in args.messages]
            for receipt in publisher.publish_many(events):
                print(_receipt_line(receipt), file=out)
            return 0
        # One async publish per line: a piped file batches itself while the window is
        # full; a person typing sees each receipt at once. Receipts print in input order.
        interactive = stdin.isatty()
        waiting: deque[Future[squall.Receipt]] = deque()
        for payload in _stdin_lines(stdin):
            waiting.append(publisher.publish_async(payload, key))
            if interactive:
                waiting[0].result()
            while waiting and waiting[0].done():
                print(_receipt_line(waiting.popleft().result()), file=out)
        publisher.flush()
        while waiting:
            print(_receipt_line(waiting.popleft().result()), file=out)
    return 0


def _cmd_subscribe_shared(client: squall.Client, args: argparse.Namespace, out: TextIO) -> int:
    """`squall subscribe --shared`: print each leased event, then ack it (at-least-once)."""
    topic = client.topic(args.topic)
    known = {info.name: info for info in topic.subscription_infos()}
    if args.shared not in known:
        topic.create_shared_subscription(
            args.shared,
            ack_deadline_ms=args.ack_deadline_ms,
            max_deliveries=args.max_deliveries,
            dead_letter_topic=args.dead_letter_topic,
            exclusive=args.exclusive,
        )
    elif not known[args.shared].shared:
        raise squall.AlreadyExists(
            f"subscription '{args.shared}' on topic '{args.topic}' is not shared: "
            "read it with --subscription"
        )
    remaining: int | None = args.count
    with topic.shared(args.shared, consumer_id=args.consumer) as consumer:
        # Bounded: each round prints or (without --follow) ends; --follow runs until Ctrl-C.
        while remaining is None or remaining > 0:
            messages = consumer.pull(max_messages=min(remaining or 100, 100))
            if not messages and not args.follow:
                break
            for message in messages:
                out.write(
                    f"{message.offset}\t{_escape(message.message.key)}\t"
                    f"{_escape(message.payload)}\n"
                )
                out.flush()
                message.ack()
                if remaining is not None:
                    remaining -= 1
    return 0


def _cmd_subscribe(client: squall.Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.shared:
        if args.subscription:
            raise UsageError("--shared and --subscription name different kinds of subscription")
        return _cmd_subscribe_shared(client, args, out)
    topic = client.topic(args.topic)
    remaining: int | None = args.count
    with topic.subscribe(
        args.subscription, start=args.start, follow=args.follow, read_from=args.read_from
    ) as sub:
        printed: int | None = None  # the last offset printed and not yet acked
        try:
            for batch in sub.batches():
                for message in batch:
                    out.write(
                        f"{message.offset}\t{_escape(message.key)}\t{_escape(message.payload)}\n"
                    )
                    printed = message.offset
                    if remaining is not None:
                        remaining -= 1
                        if remaining == 0:
                            break
                out.flush()
                # Ack once per batch, after its lines are out: at-least-once, and one
                # call per server batch rather than per event.
                if sub.durable and printed is not None:
                    sub.ack(printed)
                    printed = None
                if remaining == 0:
                    break
        except KeyboardInterrupt:
            if sub.durable and printed is not None:
                out.flush()
                sub.ack(printed)
            raise
    return 0


def _format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _quorum(node: squall.NodeStatus) -> str:
    """Nodes the group needs, marked loudly when an operator changed the rule."""
    text = str(node.quorum_required or "-")
    if node.quorum_override:
        text += f" (OVERRIDE {node.quorum_override})"
    if node.designated_primary:
        text += " (DESIGNATED PRIMARY)"
    return text


def _status_links(client: squall.Client) -> list[squall.LinkInfo] | None:
    """The cluster's topic links for status, None when they cannot be read (no replica
    answers reads): status still shows the replica table."""
    try:
        return client.links()
    except squall.SquallError:
        return None


def _cmd_status(client: squall.Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.wait_normal is not None:
        waited = cli_status_wait.wait_until_normal(
            client, args.wait_normal, args.max_lag, sys.stderr
        )
        if waited:
            return waited
    status = client.status()
    links = _status_links(client)
    if args.json:
        document = status.to_dict()
        if links is not None:
            document.update(cli_listing.links_document(links))
        if args.explain:
            document["explain"] = cli_explain.explain(status)
        print(json.dumps(document, indent=2, sort_keys=True), file=out)
        return 0
    rows: list[list[str]] = [
        [
            "id",
            "prio",
            "coord",
            "group name",
            "state",
            "group",
            "max",
            "epoch",
            "role",
            "quorum",
            "reason",
        ]
    ]
    learners = _learners(status)
    for node in status.nodes:
        # A coordinator that answered while its replica did not still says what it knows
        # (one fate per node: why the node is out of its group).
        if node.reachable or node.coordinator_id:
            rows.append(
                [
                    node.node_id,
                    str(node.priority),
                    node.coordinator_id or "-",
                    node.group_name or "-",
                    cli_explain.state_of(node),
                    ",".join(node.group) or "-",
                    str(node.max_seen),
                    str(node.epoch),
                    (f"{node.role} (learner)" if node.node_id in learners else node.role)
                    if node.reachable
                    else "-",
                    _quorum(node),
                    cli_explain.reason_of(node),
                ]
            )
        else:
            rows.append(
                [
                    node.node_id,
                    "-",
                    "-",
                    "-",
                    "unreachable",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    node.error or "-",
                ]
            )
    for line in _format_table(rows):
        print(line, file=out)
    print(
        f"master: {status.master_id or 'none'}  epoch: {status.epoch}"
        f"  (squall {squall.__version__})",
        file=out,
    )
    # The running node set (a membership change moves it away from the file's).
    master_row = next((n for n in status.nodes if n.node_id == status.master_id), None)
    if master_row is not None and master_row.membership:
        print(f"node set: {master_row.membership}", file=out)
        if learners:
            print(
                f"  learners (L): {','.join(sorted(learners))} get the log but do not vote "
                "until they have caught up (lag and ETA below)",
                file=out,
            )
        listed = {n.node_id for n in status.nodes}
        running = {
            item.split(":")[0] for item in master_row.membership.split(": ", 1)[-1].split(",")
        }
        if running != listed:
            print(
                "  the config file lists "
                + ",".join(sorted(listed))
                + ": bring it up to date with `squall cluster config export`",
                file=out,
            )
    changes = [n.membership_change for n in status.nodes if n.membership_change]
    for change in changes:
        print(f"membership change: {change}", file=out)
    # The master's view of its slaves: what each lacks and how fast it is closing the gap.
    slaves = [slave for node in status.nodes if node.reachable for slave in node.slaves]
    if slaves:
        table = [["slave", "replication", "acked (written)", "lag", "rate/s", "eta", "heard"]]
        for slave in slaves:
            eta = "-" if slave.eta_s < 0 else f"{slave.eta_s:.1f}s"
            # Silence past a heartbeat or two means the master cannot reach its replica.
            heard = "now" if slave.silent_ms < 1000 else f"{slave.silent_ms / 1000:.1f}s ago"
            table.append(
                [
                    f"{slave.node_id} (learner)" if slave.node_id in learners else slave.node_id,
                    # Not yet caught up with the master's log as of the epoch's start:
                    # under acks "group" commits do not wait for it yet.
                    slave.state + (" (catching up)" if slave.catching_up else ""),
                    str(slave.written_lsn),
                    str(slave.lag_entries),
                    f"{slave.catch_up_entries_per_s:.0f}",
                    eta,
                    heard,
                ]
            )
        for line in _format_table(table):
            print(line, file=out)
    if links:
        print("topic links:", file=out)
        for line in cli_listing.link_lines(links):
            print(f"  {line}", file=out)
    for line in cli_explain.notes(status):
        print(line, file=out)
    if args.explain:
        members = _format_table(cli_explain.member_rows(status))
        for line in cli_explain.explain_lines(status, members):
            print(line, file=out)
    return 0


def _learners(status: squall.ClusterStatus) -> set[str]:
    """The learners of the running node set the master's coordinator shows (``4:1L`` in
    ``v2 (epoch 7): 1:3,2:2,4:1L``)."""
    master_row = next((n for n in status.nodes if n.node_id == status.master_id), None)
    if master_row is None or not master_row.membership:
        return set()
    items = master_row.membership.split(": ", 1)[-1].split(",")
    return {item.split(":")[0] for item in items if item.endswith("L")}


def _run_client(args: argparse.Namespace, out: TextIO, stdin: TextIO) -> int:
    address = resolve_gateway(args)
    try:
        tls = tls_from_config(args, address)
        client = squall.connect(
            address, timeout_s=args.timeout, tls=tls, token=cli_auth.cli_token()
        )
    except ValueError as err:  # a TLS file that cannot be read
        raise UsageError(str(err)) from None
    with client:
        if args.command == "topic":
            return _cmd_topic(client, args, out)
        if args.command == "publish":
            return _cmd_publish(client, args, out, stdin)
        if args.command == "subscribe":
            return _cmd_subscribe(client, args, out)
        if args.command == "subscription":
            return cli_subscription.run(client, args, out)
        return _cmd_status(client, args, out)


# -- services ---------------------------------------------------------------------------


def _run_service(name: str, argv: list[str]) -> int:
    module_name = SERVICE_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Only the service itself missing is "not installed"; a missing dependency of a
        # present service must surface as the import error it is.
        if err.name is not None and (
            module_name == err.name or module_name.startswith(err.name + ".")
        ):
            print(
                f"squall: the {name} service is not installed ({module_name} not found)",
                file=sys.stderr,
            )
            return 1
        raise
    service_main = getattr(module, "main", None)
    if not callable(service_main):
        print(f"squall: {module_name} has no main(argv)", file=sys.stderr)
        return 1
    return int(service_main(argv))


# -- entry point ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `squall` command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(args_list)
        if args.command in SERVICE_MODULES:
            # The service parses its own options; ours only checked the required ones.
            return _run_service(args.command, args_list[args_list.index(args.command) + 1 :])
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        with cli_auth.token_file_env(getattr(args, "token_file", None)):
            return _run_command(args)
    except SystemExit as exit_:
        # argparse exits on --help (0) and on usage errors (2); report, do not exit.
        return exit_.code if isinstance(exit_.code, int) else 2
    except UsageError as err:
        print(f"squall: {err}", file=sys.stderr)
        return 2
    except cli_auth.TokenError as err:
        print(f"squall: {err}", file=sys.stderr)
        return 2


def _run_command(args: argparse.Namespace) -> int:
    try:
        handler = getattr(args, "handler", None)
        if handler is not None:  # commands that run themselves (`squall store ...`)
            return int(handler(args, sys.stdout))
        if args.command == "cluster":
            return cli_admin.run(args, sys.stdout)
        if args.command == "store":
            return cli_store.run(args, sys.stdout)
        return _run_client(args, sys.stdout, sys.stdin)
    except (UsageError, cli_auth.TokenError) as err:
        print(f"squall: {err}", file=sys.stderr)
        return 2
    except (cli_admin.AdminError, cli_store.StoreToolError, cli_certs.CertsError) as err:
        print(f"squall: {err}", file=sys.stderr)
        return 1
    except squall.SquallError as err:
        print(f"squall: {err}{_tls_hint(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`squall subscribe t | head`); that is not an error.
        _silence_stdout()
        return 0


def _tls_hint(err: squall.SquallError) -> str:
    """A hint when a plaintext call was cut off the way a TLS-only server cuts it."""
    if isinstance(err, squall.Unavailable) and "Socket closed" in str(err):
        return (
            "\nsquall: the server closed the connection at once; if the cluster runs with "
            "[tls] on, give --config FILE so this command connects with TLS"
        )
    return ""


def _silence_stdout() -> None:
    """Points stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
