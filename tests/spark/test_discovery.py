"""PySpark finds the "squall" format by itself, and Kafka's option names work, without a JVM.

Goal: `spark.read.format("squall")` needs no `register()` call: PySpark's own lookup
(the module pyspark.sql.worker.lookup_data_sources, which the JVM runs in a Python
worker at a session's first data-source call) finds `pyspark_squall.DefaultSource`.
The Spark tests' session (squall.spark.local_session, which no longer registers) reads
through it too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "pyspark", reason="the spark extra is not installed (pip install -e '.[spark]')"
)

from squall.spark._options import parse_read

BASE = {"gateway": "127.0.0.1:7100"}

_LOOKUP = """
import io, json, pickle
from pyspark.serializers import read_int
from pyspark.sql.worker.lookup_data_sources import _main
out = io.BytesIO()
_main(None, out)
out.seek(0)
found = {}
for _ in range(read_int(out)):
    name = out.read(read_int(out)).decode()
    source = pickle.loads(out.read(read_int(out)))
    found[name] = f"{source.__module__}.{source.__qualname__}"
print(json.dumps(found))
"""


def test_pyspark_own_lookup_finds_the_squall_format(tmp_path: Path) -> None:
    # The environment local_session gives the JVM (and so its Python workers).
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    prepared = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from squall.spark import make_discoverable; make_discoverable(); "
            "print(os.environ.get('PYTHONPATH', ''))",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=True,
    )
    env["PYTHONPATH"] = prepared.stdout.strip()
    looked_up = subprocess.run(
        [sys.executable, "-c", _LOOKUP],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert looked_up.returncode == 0, looked_up.stderr
    found = json.loads(looked_up.stdout.strip().splitlines()[-1])
    assert found.get("squall") == "squall.spark._source.SquallDataSource"


def test_kafka_option_names_mean_the_same() -> None:
    kafka = parse_read(
        {**BASE, "subscribe": "orders", "maxOffsetsPerTrigger": "500"}, streaming=True
    )
    ours = parse_read({**BASE, "topic": "orders", "maxEventsPerTrigger": "500"}, streaming=True)
    assert kafka == ours
    assert kafka.common.topic == "orders" and kafka.max_events_per_trigger == 500
    # Spark lower-cases option names before the source sees them.
    lowered = parse_read({**BASE, "topic": "orders", "maxoffsetspertrigger": "7"}, streaming=True)
    assert lowered.max_events_per_trigger == 7


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"topic": "a", "subscribe": "b"},
            "options 'topic' and 'subscribe' mean the same and disagree",
        ),
        ({"subscribe": "a,b"}, "names one topic, not 'a,b'"),
        ({"topic": "a", "maxOffsetsPerTrigger": "0"}, "'maxEventsPerTrigger' must be 1.."),
        ({"topic": "a", "minPartitions": "4"}, "unknown squall option 'minPartitions'"),
    ],
)
def test_kafka_option_names_are_checked_like_ours(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_read({**BASE, **options}, streaming=True)


def test_max_offsets_per_trigger_is_for_streams_as_max_events_per_trigger() -> None:
    with pytest.raises(ValueError, match="'maxEventsPerTrigger' is for streams"):
        parse_read({**BASE, "topic": "a", "maxOffsetsPerTrigger": "5"}, streaming=False)
