"""Turns grpcio's report of a stream whose client went away into one INFO line.

When an app drops a server stream (it cancelled, crashed, or refused a message over its
receive limit, as a client with default channel options does past 4 MiB) and grpcio tries
to write the next response before it has noticed the cancel, grpcio logs
`ExecuteBatchError raised in core by servicer method [...]` at ERROR with a traceback.
Nothing is wrong on the server's side: the stream is simply gone. `install` puts a filter
on grpcio's logger that rewrites exactly that record into an INFO line naming the method,
so operators are not paged for an app that went away, and every other grpcio error is
left as it is.
"""

from __future__ import annotations

import logging
import re

GRPC_LOGGER = "grpc._cython.cygrpc"
# grpcio formats the method into the message itself (or passes it as an argument).
_CLIENT_GONE = re.compile(r"ExecuteBatchError raised in core by servicer method \[(.*)\]$")
CLIENT_GONE_MESSAGE = (
    "client went away mid-stream: %s ended before a response could be written (the "
    "client cancelled, crashed or refused a message over its receive limit)"
)


class ClientGoneFilter(logging.Filter):
    """Rewrites grpcio's failed-write-to-a-gone-client record; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or "ExecuteBatchError" not in record.msg:
            return True
        matched = _CLIENT_GONE.match(record.getMessage())
        if matched is None:
            return True
        if not logging.getLogger().isEnabledFor(logging.INFO):
            return False
        record.msg = CLIENT_GONE_MESSAGE
        record.args = (matched.group(1),)
        record.levelno = logging.INFO
        record.levelname = logging.getLevelName(logging.INFO)
        record.exc_info = None
        record.exc_text = None
        return True


def install() -> None:
    """Adds the filter to grpcio's logger once."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in logger.filters):
        logger.addFilter(ClientGoneFilter())
