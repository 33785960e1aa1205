"""The data source's options and offsets, parsed and checked without Spark.

Everything here is pure (no pyspark, no network): option strings in, frozen values out,
and `ValueError` with a sentence naming the option and the bad value. The Spark classes
call these on the driver, so a bad option fails `load()`, `save()` or `start()` before a
task runs; the unit tests run them without a JVM.

Offsets: a Squall topic is one ordered log, so a position is one number, the offset of
the next event to read. In a Structured Streaming checkpoint it is the JSON object
`{"topic": NAME, "offset": N}` (the topic is kept so a checkpoint reused for another topic
is refused instead of silently skipping or re-reading events). Options take `earliest`,
`latest`, a plain offset (`42`) or that same JSON object.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

import squall
from squall._seek import time_ms as squall_time_ms

Position = Literal["earliest", "latest"] | int

# Options every mode understands, and those only one mode does (checked so a typo such as
# `maxEventPerSplit` is an error instead of an ignored option). Spark lower-cases keys.
COMMON_OPTIONS = (
    "gateway",
    "topic",
    "timeoutMs",
    "tlsCaFile",
    "tlsCertFile",
    "tlsKeyFile",
    "tlsServerName",
)
READ_OPTIONS = (
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "endingTimestamp",
    "maxEventsPerSplit",
    "maxEventsPerTrigger",
)
WRITE_OPTIONS = ("writeId", "batchEvents", "rowsPerPublisher")
# Spark adds these itself (file-sink style paths, checkpoints); they are not ours to refuse.
SPARK_OPTIONS = ("path", "checkpointLocation", "queryName")
# Spark's Kafka source's names for options that mean the same here, so a query moved from
# Kafka keeps its options: a Squall topic is one partition whose offsets count events, so
# Kafka's offsets per trigger are events per trigger, and `subscribe` names the topic
# (one: a query reads one Squall topic). startingOffsets and endingOffsets have Kafka's
# names already, and so have startingTimestamp and endingTimestamp (Kafka's milliseconds
# since the epoch; an ISO 8601 time with a zone is also taken). Options with no equal
# here (minPartitions, failOnDataLoss, ...) stay errors rather than being silently ignored.
KAFKA_ALIASES = {
    "maxOffsetsPerTrigger": "maxEventsPerTrigger",
    "subscribe": "topic",
}

TIMEOUT_MS_DEFAULT = 30_000
TIMEOUT_MS_BOUNDS = (100, 3_600_000)
MAX_EVENTS_PER_SPLIT_DEFAULT = 100_000
MAX_EVENTS_PER_SPLIT_BOUNDS = (1, 10_000_000)
MAX_EVENTS_PER_TRIGGER_BOUNDS = (1, 1_000_000_000)
BATCH_EVENTS_DEFAULT = 1_000
# squall.BATCH_EVENTS_MAX: one publish request is one gRPC message.
BATCH_EVENTS_BOUNDS = (1, 10_000)
# Half the replica's default dedupe_window (100,000): every sequence of one publisher id
# stays inside the window, so a retry of any row is recognised (see docs/spark.md).
ROWS_PER_PUBLISHER_DEFAULT = 50_000
ROWS_PER_PUBLISHER_BOUNDS = (1, 100_000_000)
# A publisher id is at most 128 printable ASCII characters (services/common/names.py); ours
# are "spark-" + write id + "-b<batch>-p<partition>-c<chunk>" (up to ~50 characters
# besides the write id), so a write id is at most 64, of characters that read plainly.
WRITE_ID_MAX_CHARS = 64
WRITE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclasses.dataclass(frozen=True)
class CommonOptions:
    """Where the topic is: the gateway, the topic's name and the per-call deadline."""

    gateway: str
    topic: str
    timeout_ms: int
    # TLS to the cluster (docs/security.md); the files must exist on every executor.
    tls: squall.TlsOptions | None = None

    @property
    def timeout_s(self) -> float:
        """The deadline of each unary call, in seconds (what squall.connect takes)."""
        return self.timeout_ms / 1000


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """What a batch read or a stream reads, and how it is cut into Spark partitions."""

    common: CommonOptions
    starting: Position
    ending: Position
    max_events_per_split: int
    max_events_per_trigger: int | None
    # A time range instead of offsets (ms since the Unix epoch): the read starts at the
    # first event published at or after starting_timestamp_ms and ends before the first at
    # or after ending_timestamp_ms; resolved on the driver when the query is planned.
    starting_timestamp_ms: int | None = None
    ending_timestamp_ms: int | None = None


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How a write publishes: an optional caller-chosen write id and batching bounds."""

    common: CommonOptions
    write_id: str | None
    batch_events: int
    rows_per_publisher: int


_ALIAS_OF = {alias.lower(): name for alias, name in KAFKA_ALIASES.items()}


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    """Lower-cased names (Spark's own convention), Kafka aliases under their Squall name."""
    lowered: dict[str, str] = {}
    given: dict[str, str] = {}
    for key, value in options.items():
        raw = str(key)
        name = _ALIAS_OF.get(raw.lower(), raw).lower()
        if name in lowered and lowered[name] != str(value):
            raise ValueError(
                f"options {given[name]!r} and {raw!r} mean the same and disagree "
                f"({lowered[name]!r} vs {str(value)!r}): give one"
            )
        lowered[name] = str(value)
        given[name] = raw
    return lowered


def check_known(options: Mapping[str, str], allowed: tuple[str, ...]) -> None:
    """Refuses an option no mode of the source knows (a typo would otherwise be ignored)."""
    known = {name.lower(): name for name in (*COMMON_OPTIONS, *SPARK_OPTIONS, *allowed)}
    known |= {a.lower(): a for a, name in KAFKA_ALIASES.items() if name.lower() in known}
    for key in options:
        if key.lower() not in known:
            names = ", ".join(sorted((*COMMON_OPTIONS, *allowed)))
            # Spark lower-cases option names before we see them.
            raise ValueError(
                f"unknown squall option {key!r} (names are not case-sensitive); "
                f"the options here are: {names}"
            )


def _int(
    options: Mapping[str, str], name: str, default: int | None, bounds: tuple[int, int]
) -> int:
    raw = options.get(name.lower())
    if raw is None:
        if default is None:
            raise ValueError(f"option {name!r} is required")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"option {name!r} must be an integer, not {raw!r}") from None
    low, high = bounds
    if not low <= value <= high:
        raise ValueError(f"option {name!r} must be {low}..{high}, not {value}")
    return value


def parse_common(options: Mapping[str, str]) -> CommonOptions:
    """The gateway, topic and timeout options; ValueError names a missing or bad one."""
    lowered = _lower(options)
    gateway = lowered.get("gateway", "").strip()
    if not gateway:
        raise ValueError(
            "option 'gateway' is required: the host:port of a Squall gateway "
            "(.option('gateway', '127.0.0.1:7100'))"
        )
    host, sep, port = gateway.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"option 'gateway' must be host:port, not {gateway!r}")
    topic = lowered.get("topic", "").strip()
    if not topic:
        raise ValueError("option 'topic' is required: the name of the Squall topic")
    if "," in topic:
        raise ValueError(
            f"option 'topic' (or Kafka's 'subscribe') names one topic, not {topic!r}: "
            "a query reads one Squall topic (union several queries' DataFrames instead)"
        )
    timeout_ms = _int(lowered, "timeoutMs", TIMEOUT_MS_DEFAULT, TIMEOUT_MS_BOUNDS)
    return CommonOptions(
        gateway=gateway, topic=topic, timeout_ms=timeout_ms, tls=_parse_tls(lowered)
    )


def _parse_tls(lowered: Mapping[str, str]) -> squall.TlsOptions | None:
    """tlsCaFile (and a client certificate for writes through publisher proxies), if given."""
    ca_file = lowered.get("tlscafile", "").strip()
    cert_file = lowered.get("tlscertfile", "").strip()
    key_file = lowered.get("tlskeyfile", "").strip()
    server_name = lowered.get("tlsservername", "").strip()
    if not ca_file:
        if cert_file or key_file or server_name:
            raise ValueError(
                "options 'tlsCertFile', 'tlsKeyFile' and 'tlsServerName' need 'tlsCaFile'"
            )
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("options 'tlsCertFile' and 'tlsKeyFile' go together: give both or neither")
    return squall.TlsOptions(
        ca_file=ca_file,
        cert_file=cert_file or None,
        key_file=key_file or None,
        server_name=server_name or None,
    )


def parse_position(raw: str, name: str, topic: str | None = None) -> Position:
    """An offset option: earliest, latest, a plain offset, or {"topic": T, "offset": N}."""
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return "earliest" if text.lower() == "earliest" else "latest"
    if text.isdigit():
        return int(text)
    if text.startswith("{"):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"option {name!r} is not valid JSON ({exc.msg}): {raw!r}") from None
        return offset_from_json(document, topic, what=f"option {name!r}")
    raise ValueError(
        f"option {name!r} must be 'earliest', 'latest', an offset >= 0 or "
        f'{{"topic": ..., "offset": N}}, not {raw!r}'
    )


def parse_timestamp(raw: str, name: str) -> int:
    """A time option as milliseconds since the Unix epoch: Kafka's form (a number of
    milliseconds) or an ISO 8601 time with a zone (`2026-11-25T09:00:00Z`)."""
    text = raw.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ValueError(
            f"option {name!r} must be milliseconds since the Unix epoch or an ISO 8601 time "
            f"with a zone (2026-11-25T09:00:00Z), not {raw!r}"
        )
    return squall_time_ms(moment)


def parse_read(options: Mapping[str, str], *, streaming: bool) -> ReadOptions:
    """A read's options; a batch read defaults to earliest..latest, a stream to latest."""
    check_known(options, READ_OPTIONS)
    common = parse_common(options)
    lowered = _lower(options)
    for side, what in (("starting", "start"), ("ending", "end")):
        if f"{side}offsets" in lowered and f"{side}timestamp" in lowered:
            raise ValueError(
                f"options '{side}Offsets' and '{side}Timestamp' both place the read's {what}: "
                "give one"
            )
    starting_ms = (
        parse_timestamp(lowered["startingtimestamp"], "startingTimestamp")
        if "startingtimestamp" in lowered
        else None
    )
    if streaming and "endingtimestamp" in lowered:
        raise ValueError(
            "option 'endingTimestamp' is for batch reads; a stream reads on "
            "(use trigger(availableNow=True) to stop at the end that exists at start)"
        )
    ending_ms = (
        parse_timestamp(lowered["endingtimestamp"], "endingTimestamp")
        if "endingtimestamp" in lowered
        else None
    )
    if starting_ms is not None and ending_ms is not None and ending_ms < starting_ms:
        raise ValueError(
            f"option 'endingTimestamp' ({ending_ms}) is before 'startingTimestamp' ({starting_ms})"
        )
    starting = parse_position(
        lowered.get("startingoffsets", "latest" if streaming else "earliest"),
        "startingOffsets",
        common.topic,
    )
    if streaming and "endingoffsets" in lowered:
        raise ValueError(
            "option 'endingOffsets' is for batch reads; a stream reads on "
            "(use trigger(availableNow=True) to stop at the end that exists at start)"
        )
    ending = parse_position(lowered.get("endingoffsets", "latest"), "endingOffsets", common.topic)
    if ending == "earliest":
        raise ValueError("option 'endingOffsets' cannot be 'earliest' (that reads nothing)")
    if isinstance(starting, int) and isinstance(ending, int) and ending < starting:
        raise ValueError(
            f"option 'endingOffsets' ({ending}) is below 'startingOffsets' ({starting})"
        )
    per_split = _int(
        lowered, "maxEventsPerSplit", MAX_EVENTS_PER_SPLIT_DEFAULT, MAX_EVENTS_PER_SPLIT_BOUNDS
    )
    per_trigger: int | None = None
    if "maxeventspertrigger" in lowered:
        if not streaming:
            raise ValueError("option 'maxEventsPerTrigger' is for streams, not batch reads")
        per_trigger = _int(lowered, "maxEventsPerTrigger", None, MAX_EVENTS_PER_TRIGGER_BOUNDS)
    return ReadOptions(common, starting, ending, per_split, per_trigger, starting_ms, ending_ms)


def parse_write(options: Mapping[str, str]) -> WriteOptions:
    """A write's options; ValueError names a bad one."""
    check_known(options, WRITE_OPTIONS)
    common = parse_common(options)
    lowered = _lower(options)
    write_id = lowered.get("writeid")
    if write_id is not None and not WRITE_ID_RE.fullmatch(write_id):
        raise ValueError(
            "option 'writeId' must be 1..64 letters, digits or ._:- (starting with a letter "
            f"or digit), not {write_id!r}"
        )
    batch_events = _int(lowered, "batchEvents", BATCH_EVENTS_DEFAULT, BATCH_EVENTS_BOUNDS)
    rows = _int(lowered, "rowsPerPublisher", ROWS_PER_PUBLISHER_DEFAULT, ROWS_PER_PUBLISHER_BOUNDS)
    return WriteOptions(common, write_id, batch_events, rows)


# --- offsets ------------------------------------------------------------------------


def offset_to_json(topic: str, offset: int) -> dict[str, Any]:
    """The checkpointed form of a position: {"topic": T, "offset": N}."""
    return {"topic": topic, "offset": offset}


def offset_from_json(document: Any, topic: str | None, *, what: str = "offset") -> int:
    """The offset in a checkpointed position; ValueError if malformed or for another topic.

    Spark hands offsets back as parsed JSON, so numbers may arrive as strings ("12"); both
    forms are accepted.
    """
    if not isinstance(document, dict) or "offset" not in document:
        raise ValueError(f'{what} must be {{"topic": ..., "offset": N}}, not {document!r}')
    value = document["offset"]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: offset must be an integer >= 0, not {value!r}")
    named = document.get("topic")
    if topic is not None and named is not None and named != topic:
        raise ValueError(
            f"{what} is for topic {named!r}, but this query reads topic {topic!r} "
            "(a checkpoint belongs to one topic: use a new checkpointLocation)"
        )
    return value


def resolve(position: Position, first_offset: int, next_offset: int, name: str) -> int:
    """A position as an offset in [first_offset, next_offset]; ValueError outside it."""
    if position == "earliest":
        return first_offset
    if position == "latest":
        return next_offset
    if position < first_offset:
        raise ValueError(
            f"option {name!r} is {position}, below the topic's first offset {first_offset}"
        )
    if position > next_offset:
        raise ValueError(
            f"option {name!r} is {position}, beyond the topic's end (next offset {next_offset})"
        )
    return position


def split(start: int, end: int, max_events: int) -> list[tuple[int, int]]:
    """[start, end) cut into consecutive ranges of at most max_events offsets each."""
    if max_events < 1:
        raise ValueError(f"max_events must be >= 1, not {max_events}")
    return [(lo, min(lo + max_events, end)) for lo in range(start, end, max_events)]


def admit(start: int, available: int, max_events: int | None, target: int | None) -> int:
    """The end offset of the next micro-batch: bounded by the limit and availableNow target."""
    end = available
    if target is not None:
        end = min(end, target)
    if max_events is not None:
        end = min(end, start + max_events)
    # Never behind start: a topic destroyed and re-created shorter is caught elsewhere.
    return max(end, start)


# --- publisher ids ------------------------------------------------------------------


def publisher_id(write_id: str, batch_id: int | None, partition: int, chunk: int) -> str:
    """The publisher id of one chunk of one Spark partition of one write (or micro-batch).

    A retried task, and a micro-batch replayed after a restart, compute the same ids and
    the same sequences for the same rows, so the replica stores each row once.
    """
    batch = "" if batch_id is None else f"-b{batch_id}"
    return f"spark-{write_id}{batch}-p{partition}-c{chunk}"
