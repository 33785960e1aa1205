"""Logging set-up shared by every service: one line per record, tagged with service and node.

Text lines read ``2026-11-21T23:59:01.123Z INFO replica[n1] became master epoch=4 lsn=17``;
JSON lines carry the same data as one object per line for log shippers. Call sites attach
structured fields (epoch, lsn, peer, ...) with ``log_fields`` or a ``bind``-ed logger
rather than formatting them into the message, so both formats can show them as fields.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

from services.common.config import LogConfig

# The LogRecord attribute that carries structured fields.
FIELDS_ATTR = "squall_fields"
# Keys of a JSON line that fields may not overwrite; a clashing field gets a "field_" prefix.
_JSON_RESERVED_KEYS = frozenset({"ts", "level", "service", "node", "logger", "msg", "exc"})
# Marks the handler setup_logging installs, so a second call replaces it instead of adding one.
_HANDLER_MARK = "_squall_handler"


def setup_logging(
    config: LogConfig, service: str, node_id: str, *, stream: TextIO | None = None
) -> None:
    """Send the root logger's records to stream (stderr) in the configured format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    formatter: logging.Formatter
    if config.format == "json":
        formatter = JsonFormatter(service, node_id)
    else:
        formatter = TextFormatter(service, node_id)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False):
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(config.level)


def log_fields(
    logger: logging.Logger | logging.LoggerAdapter[Any],
    level: int,
    msg: str,
    **fields: object,
) -> None:
    """Log msg at level with structured fields, e.g. log_fields(log, INFO, "m", epoch=3)."""
    logger.log(level, msg, extra={FIELDS_ATTR: fields}, stacklevel=2)


class BoundLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger that adds fixed fields (node, epoch, ...) and per-call fields=... to records."""

    def __init__(self, logger: logging.Logger, fields: Mapping[str, object]) -> None:
        super().__init__(logger, {FIELDS_ATTR: dict(fields)})

    def bind(self, **fields: object) -> BoundLogger:
        """A logger with these fields added to the ones already bound."""
        return BoundLogger(self.logger, {**self.bound_fields, **fields})

    @property
    def bound_fields(self) -> dict[str, object]:
        """The fields every record of this logger carries."""
        extra = self.extra or {}
        fields = extra.get(FIELDS_ATTR, {})
        return dict(fields) if isinstance(fields, Mapping) else {}

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        """Merge bound fields, a per-call fields= mapping and any extra= fields."""
        call_fields = kwargs.pop("fields", None) or {}
        extra = dict(kwargs.get("extra") or {})
        merged = {**self.bound_fields, **extra.get(FIELDS_ATTR, {}), **call_fields}
        extra[FIELDS_ATTR] = merged
        kwargs["extra"] = extra
        return msg, kwargs


def bind(logger: logging.Logger | str, **fields: object) -> BoundLogger:
    """A BoundLogger for logger (or the logger of that name) carrying fields on every line."""
    base = logging.getLogger(logger) if isinstance(logger, str) else logger
    return BoundLogger(base, fields)


def record_fields(record: logging.LogRecord) -> dict[str, object]:
    """The structured fields attached to a record (empty when none)."""
    fields = getattr(record, FIELDS_ATTR, None)
    return dict(fields) if isinstance(fields, Mapping) else {}


def format_timestamp(created: float) -> str:
    """A record time as UTC ISO 8601 with milliseconds, e.g. 2026-11-21T23:59:01.123Z."""
    moment = datetime.datetime.fromtimestamp(created, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _text_value(value: object) -> str:
    """A field value for a text line: bare when it is one token, else JSON-quoted."""
    text = value if isinstance(value, str) else str(value)
    if text and not any(char.isspace() or char in '"=' for char in text):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    """'<time> <LEVEL> <service>[<node>] <message> key=value ...' plus any traceback."""

    def __init__(self, service: str, node_id: str) -> None:
        super().__init__()
        self._prefix = f"{service}[{node_id}]"

    def format(self, record: logging.LogRecord) -> str:
        """One line per record; exception tracebacks follow on their own lines."""
        parts = [format_timestamp(record.created), record.levelname, self._prefix]
        parts.append(record.getMessage())
        parts.extend(f"{key}={_text_value(value)}" for key, value in record_fields(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, node, logger, msg, fields, exc."""

    def __init__(self, service: str, node_id: str) -> None:
        super().__init__()
        self._service = service
        self._node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single-line JSON object."""
        line: dict[str, object] = {
            "ts": format_timestamp(record.created),
            "level": record.levelname,
            "service": self._service,
            "node": self._node_id,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            line[f"field_{key}" if key in _JSON_RESERVED_KEYS else key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)
