"""The squall format's option and offset rules, without a JVM (no SparkSession, no cluster).

Goal: every bad option is refused with a sentence naming it; offsets, splits, admission
and publisher ids follow the documented rules (a retry computes the same ids).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "pyspark", reason="the spark extra is not installed (pip install -e './clients[spark]')"
)

import squall
from squall.spark._options import (
    admit,
    offset_from_json,
    offset_to_json,
    parse_read,
    parse_write,
    publisher_id,
    resolve,
    split,
)

BASE = {"gateway": "127.0.0.1:7100", "topic": "orders"}


def test_a_batch_read_defaults_to_the_whole_topic_and_a_stream_to_its_end() -> None:
    batch = parse_read(BASE, streaming=False)
    assert (batch.starting, batch.ending) == ("earliest", "latest")
    stream = parse_read(BASE, streaming=True)
    assert stream.starting == "latest"
    assert stream.max_events_per_trigger is None


def test_offsets_accept_names_numbers_and_the_checkpoint_json() -> None:
    options = {
        **BASE,
        "startingOffsets": " 12 ",
        "endingOffsets": '{"topic": "orders", "offset": 40}',
        "maxEventsPerSplit": "7",
    }
    read = parse_read(options, streaming=False)
    assert (read.starting, read.ending, read.max_events_per_split) == (12, 40, 7)
    assert offset_from_json(offset_to_json("orders", 9), "orders") == 9
    # Spark may hand an offset back with the number as a string.
    assert offset_from_json({"topic": "orders", "offset": "9"}, "orders") == 9


def test_a_time_range_takes_kafkas_milliseconds_or_an_iso_time() -> None:
    read = parse_read(
        {
            **BASE,
            "startingTimestamp": "1764061200000",
            "endingTimestamp": "2025-11-25T10:00:00+01:00",
        },
        streaming=False,
    )
    assert (read.starting_timestamp_ms, read.ending_timestamp_ms) == (
        1_764_061_200_000,
        1_764_061_200_000,
    )
    # Spark lower-cases option names; a stream may start at a time too.
    assert parse_read({**BASE, "startingtimestamp": "5"}, streaming=True).starting_timestamp_ms == 5
    assert parse_read(BASE, streaming=False).starting_timestamp_ms is None


@pytest.mark.parametrize(
    ("options", "streaming", "message"),
    [
        ({"topic": "t"}, False, "option 'gateway' is required"),
        ({"gateway": "h:1"}, False, "option 'topic' is required"),
        ({**BASE, "gateway": "localhost"}, False, "must be host:port"),
        ({**BASE, "gateway": "h:99999"}, False, "must be host:port"),
        ({**BASE, "startingOffsets": "-3"}, False, "option 'startingOffsets' must be"),
        ({**BASE, "startingOffsets": "{nope"}, False, "is not valid JSON"),
        ({**BASE, "endingOffsets": '{"offset": true}'}, False, "offset must be an integer"),
        ({**BASE, "endingOffsets": '{"topic": "other", "offset": 3}'}, False, "topic 'other'"),
        ({**BASE, "endingOffsets": "earliest"}, False, "cannot be 'earliest'"),
        ({**BASE, "startingOffsets": "9", "endingOffsets": "3"}, False, "is below"),
        ({**BASE, "maxEventsPerSplit": "0"}, False, "'maxEventsPerSplit' must be 1.."),
        ({**BASE, "maxEventsPerSplit": "ten"}, False, "must be an integer"),
        ({**BASE, "maxEventsPerTrigger": "5"}, False, "is for streams"),
        ({**BASE, "endingOffsets": "latest"}, True, "is for batch reads"),
        ({**BASE, "timeoutMs": "5"}, False, "'timeoutMs' must be 100.."),
        ({**BASE, "writeId": "x"}, False, "unknown squall option 'writeId'"),
        ({**BASE, "startingTimestamp": "yesterday"}, False, "milliseconds since the Unix"),
        ({**BASE, "endingTimestamp": "2026-11-25T09:00:00"}, False, "with a zone"),
        (
            {**BASE, "startingTimestamp": "1000", "startingOffsets": "3"},
            False,
            "options 'startingOffsets' and 'startingTimestamp' both place the read's start",
        ),
        (
            {**BASE, "endingTimestamp": "1000", "endingOffsets": "3"},
            False,
            "options 'endingOffsets' and 'endingTimestamp' both place the read's end",
        ),
        (
            {**BASE, "startingTimestamp": "2000", "endingTimestamp": "1000"},
            False,
            "'endingTimestamp' (1000) is before 'startingTimestamp' (2000)",
        ),
        ({**BASE, "endingTimestamp": "1000"}, True, "is for batch reads"),
    ],
)
def test_bad_read_options_are_refused_with_a_sentence(
    options: dict[str, str], streaming: bool, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        parse_read(options, streaming=streaming)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({**BASE, "writeId": "has space"}, "option 'writeId' must be 1..64"),
        ({**BASE, "writeId": "x" * 65}, "option 'writeId' must be 1..64"),
        ({**BASE, "batchEvents": "20000"}, "'batchEvents' must be 1..10000"),
        ({**BASE, "rowsPerPublisher": "0"}, "'rowsPerPublisher' must be 1.."),
        ({**BASE, "startingOffsets": "0"}, "unknown squall option 'startingOffsets'"),
    ],
)
def test_bad_write_options_are_refused_with_a_sentence(
    options: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        parse_write(options)
    assert message in str(raised.value)


def test_positions_resolve_inside_the_topic_only() -> None:
    assert resolve("earliest", 0, 50, "startingOffsets") == 0
    assert resolve("latest", 0, 50, "startingOffsets") == 50
    assert resolve(50, 0, 50, "endingOffsets") == 50
    with pytest.raises(ValueError, match="beyond the topic's end"):
        resolve(51, 0, 50, "endingOffsets")


def test_a_range_splits_into_consecutive_bounded_pieces() -> None:
    assert split(12, 40, 7) == [(12, 19), (19, 26), (26, 33), (33, 40)]
    assert split(5, 5, 10) == []
    pieces = split(0, 1001, 100)
    assert pieces[-1] == (1000, 1001)
    assert all(hi - lo <= 100 for lo, hi in pieces)


def test_admission_respects_the_limit_and_the_available_now_target() -> None:
    assert admit(10, 100, None, None) == 100
    assert admit(10, 100, 25, None) == 35
    assert admit(10, 100, 25, 20) == 20
    # Nothing new: the end stays at the start, which Spark reads as "no micro-batch".
    assert admit(30, 30, 10, None) == 30


def test_publisher_ids_name_the_write_batch_partition_and_chunk() -> None:
    assert publisher_id("w1", 4, 2, 0) == "spark-w1-b4-p2-c0"
    assert publisher_id("w1", None, 3, 1) == "spark-w1-p3-c1"
    # Another micro-batch, partition or chunk never shares an id.
    ids = {publisher_id("w1", b, p, c) for b in (None, 1, 11) for p in (1, 11) for c in (1, 11)}
    assert len(ids) == 12
    # Within the 128-character limit of a publisher id, whatever the numbers.
    assert len(publisher_id("x" * 64, 2**63, 2**31, 2**31)) <= 128


def test_tls_options_build_the_librarys_tls_settings() -> None:
    assert parse_read(BASE, streaming=False).common.tls is None
    tls = parse_write(
        {
            **BASE,
            "tlsCaFile": "/etc/squall/tls/ca.crt",
            "tlscertfile": "/etc/squall/tls/spark.crt",  # Spark lower-cases keys
            "tlsKeyFile": "/etc/squall/tls/spark.key",
        }
    ).common.tls
    assert tls == squall.TlsOptions(
        ca_file="/etc/squall/tls/ca.crt",
        cert_file="/etc/squall/tls/spark.crt",
        key_file="/etc/squall/tls/spark.key",
    )
    with pytest.raises(ValueError, match="'tlsCertFile' and 'tlsKeyFile' go together"):
        parse_read({**BASE, "tlsCaFile": "ca.crt", "tlsCertFile": "a.crt"}, streaming=False)
    with pytest.raises(ValueError, match="need 'tlsCaFile'"):
        parse_read({**BASE, "tlsServerName": "g1"}, streaming=False)
