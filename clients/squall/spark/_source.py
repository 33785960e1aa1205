"""The `squall` format: Spark's entry point that hands out the readers and writers.

Spark creates this object from the options in a Python process of its own (several times
per query) and pickles it, so it holds the options only. Each hook parses the options for
its mode and checks the topic before returning, so a bad option or an unreachable gateway
fails `load()`, `save()` or `start()` with a sentence, not a task later.
"""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from squall.spark._options import (
    READ_OPTIONS,
    WRITE_OPTIONS,
    check_known,
    parse_common,
    parse_position,
)
from squall.spark._options import parse_read as _parse_read
from squall.spark._options import parse_write as _parse_write
from squall.spark._reader import SCHEMA, SquallReader, SquallStreamReader
from squall.spark._topic import topic_info
from squall.spark._writer import SquallStreamWriter, SquallWriter


class SquallDataSource(DataSource):
    """Reads, streams and writes Squall topics: `spark.read.format("squall")` and friends."""

    @classmethod
    def name(cls) -> str:
        """The format name: "squall"."""
        return "squall"

    def schema(self) -> StructType:
        """The fixed columns; called by `load()`, so it also checks the options and topic."""
        check_known(self.options, READ_OPTIONS + WRITE_OPTIONS)
        common = parse_common(self.options)
        for name in ("startingOffsets", "endingOffsets"):
            raw = self.options.get(name)
            if raw is not None:
                parse_position(str(raw), name, common.topic)
        topic_info(common, readable=True)
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        """A batch read over the offsets startingOffsets..endingOffsets."""
        return SquallReader(_parse_read(self.options, streaming=False), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """A streaming read from startingOffsets (default latest) or the checkpoint."""
        return SquallStreamReader(_parse_read(self.options, streaming=True), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """A batch write; topics are append-only, so overwrite is refused."""
        if overwrite:
            raise ValueError(
                "Squall topics are append-only: write with mode('append'), not 'overwrite'"
            )
        return SquallWriter(_parse_write(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """A streaming sink, append output mode (Spark offers Python sinks no update mode)."""
        if overwrite:
            raise ValueError(
                "Squall topics are append-only: the complete output mode, which rewrites the "
                "whole result each micro-batch, cannot replace what a topic holds"
            )
        return SquallStreamWriter(_parse_write(self.options), schema)
