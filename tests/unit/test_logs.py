"""Log lines: every line of a service says where its node stands (epoch, LSN, role), in
text and JSON alike, without repeating what the message already says, and a line logged
inside a sampled trace names the trace."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from squall_server.common.config import LogConfig
from squall_server.common.logs import bind, log_fields, set_log_context, setup_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """The root logger's Squall handler writes here for one test."""
    out = io.StringIO()
    yield out
    set_log_context(None)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_squall_handler", False):
            root.removeHandler(handler)


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_text_lines_carry_the_node_context_unless_the_message_has_it(
    stream: io.StringIO,
) -> None:
    setup_logging(LogConfig(format="text"), "replica", "n1", stream=stream)
    state = {"epoch": 4, "lsn": 17}
    set_log_context(lambda: {"role": "master", **state})
    log = logging.getLogger("squall.test")
    log.info("stream to n2 open")
    state["lsn"] = 18
    log.info("replica n1 is master: epoch=4 lsn=18 members=n1,n2")
    first, second = _lines(stream)
    assert first.endswith("INFO replica[n1] stream to n2 open role=master epoch=4 lsn=17")
    # Fields the message spells out are not repeated; the others still come.
    assert second.endswith("replica n1 is master: epoch=4 lsn=18 members=n1,n2 role=master")


def test_call_site_fields_win_over_the_context(stream: io.StringIO) -> None:
    setup_logging(LogConfig(format="json"), "coordinator", "n2", stream=stream)
    set_log_context(lambda: {"epoch": 7, "state": "normal"})
    log_fields(logging.getLogger("squall.test"), logging.WARNING, "peer refused", epoch=8)
    bind("squall.test", peer="n3").info("merge")
    first, second = (json.loads(line) for line in _lines(stream))
    assert (first["node"], first["epoch"], first["state"], first["msg"]) == (
        "n2",
        8,
        "normal",
        "peer refused",
    )
    assert (second["peer"], second["epoch"]) == ("n3", 7)


def test_a_failing_context_does_not_lose_the_line(stream: io.StringIO) -> None:
    setup_logging(LogConfig(format="text"), "gateway", "g1", stream=stream)

    def broken() -> dict[str, object]:
        raise KeyError("gone")

    set_log_context(broken)
    logging.getLogger("squall.test").error("still logged")
    (line,) = _lines(stream)
    assert "still logged" in line and "context_error=" in line


def test_lines_inside_a_sampled_trace_name_it(stream: io.StringIO) -> None:
    setup_logging(LogConfig(format="json"), "replica", "n1", stream=stream)
    tracer = TracerProvider().get_tracer("test")
    log = logging.getLogger("squall.test")
    log.info("outside")
    with tracer.start_as_current_span("publish") as span:
        log.info("inside")
        context = span.get_span_context()
    outside, inside = (json.loads(line) for line in _lines(stream))
    assert "trace_id" not in outside
    assert inside["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == format(context.span_id, "016x")
