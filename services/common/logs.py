"""Logging set-up shared by every service: one line per record, tagged with service and node.

Text lines read ``2026-11-21T23:59:01.123Z INFO replica[n1] became master epoch=4 lsn=17``;
JSON lines carry the same data as one object per line for log shippers. Call sites attach
structured fields (epoch, lsn, peer, ...) with ``log_fields`` or a ``bind``-ed logger
rather than formatting them into the message, so both formats can show them as fields.

Every line of a service also carries its node's state as fields: a service registers a
provider with ``set_log_context`` (the replica: ``epoch``, ``lsn``, ``role``; the
coordinator: ``epoch``, ``state``; the gateway: ``master``, ``epoch``), read when the
record is made, so a line logged anywhere in the process says where the node stood. A
text line shows such a field only when the message does not already spell it out
(``epoch=4`` in the message); a JSON line always has it. Lines logged while a sampled
trace is current carry ``trace_id`` and ``span_id``, to jump from a log line to its trace.

No secret reaches a log line: both formatters pass everything they write (message, fields,
tracebacks) through ``redact``, which masks a bearer or basic credential and the value of
any key named like a credential (``authorization``, ``token``, ``password``, ``secret``,
``api_key``, ...) and the password in an address's user info (``http://user:pw@host``,
as an OTLP exporter logs its endpoint) wherever it appears — a metadata tuple, a
``key=value`` field, a dict repr, an exception message. It is generic on purpose: no call
site has to remember it.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TextIO

from opentelemetry import trace

from squall_server.common import grpc_log
from squall_server.common.config import LogConfig

# The LogRecord attribute that carries structured fields.
FIELDS_ATTR = "squall_fields"
# Keys of a JSON line that fields may not overwrite; a clashing field gets a "field_" prefix.
_JSON_RESERVED_KEYS = frozenset({"ts", "level", "service", "node", "logger", "msg", "exc"})
# The LogRecord attribute that carries the process's context fields (set_log_context).
CONTEXT_ATTR = "squall_context"
# Marks the handler setup_logging installs, so a second call replaces it instead of adding one.
_HANDLER_MARK = "_squall_handler"

# What replaces a secret in a log line.
REDACTED = "[REDACTED]"
# A credential after its scheme: "Bearer abc.def", "Basic dXNlcjpwYXNz" (Basic only before
# base64 of 8 characters or more, so "basic checks" in prose stays).
_SCHEME_CREDENTIAL = re.compile(
    r"(?i)\b(bearer)(?:\s+|%20)[^\s\"',)\]}&;\\]+"
    r"|\b(basic)(?:\s+|%20)(?=[A-Za-z0-9+/]{8,}={0,2}\b)[^\s\"',)\]}&;\\]+"
)
# A credential-named key and its value, however quoted or separated: authorization=x,
# 'authorization', 'x'  "token": "x"  password: x. A quoted value is masked to its closing
# quote; a bare one ends at a space, quote, comma, bracket, & ; or backslash, so a JSON or
# repr line around it stays intact.
_CREDENTIAL_KEY = (
    r"(?:proxy-)?authorization|x-api-key|api[_-]?key|access[_-]?token|refresh[_-]?token"
    r"|bearer[_-]?token|auth[_-]?token|token|password|passwd|secret|client[_-]?secret"
)
_KEYED_CREDENTIAL = re.compile(
    r"(?i)(?<![A-Za-z0-9_-])([\"']?(?:" + _CREDENTIAL_KEY + r")[\"']?\s*(?:[:=]|,)\s*)"
    r"(?!(?:bearer |basic )?\[REDACTED\])(?:(?:bearer|basic|digest)\s+)?"
    r"(?:\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\"'\s,)\]}&;\\]+)"
)


# A password in an address's user info: http://user:secret@host, user:secret@host:port.
_USERINFO_CREDENTIAL = re.compile(
    r"(?<![^\s/\"'(=,\[])([^\s:@/\"'(=,\[\]]+):([^\s@/\"']+)@(?=[\w\[])"
)


# Every credential the expressions above match contains one of these (lower-cased).
_TRIGGERS = ("bearer", "basic", "@", "authorization", "api", "token", "passw", "secret")


def _mask(match: re.Match[str]) -> str:
    value = match.group(0)[len(match.group(1)) :]
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match.group(1)}{quote}{REDACTED}{quote}"


def redact(text: str) -> str:
    """text with every credential it holds replaced by REDACTED."""
    if not text:
        return text
    lowered = text.lower()
    if not any(trigger in lowered for trigger in _TRIGGERS):
        return text  # the common case, without running the expressions
    text = _SCHEME_CREDENTIAL.sub(lambda m: f"{m.group(1) or m.group(2)} {REDACTED}", text)
    text = _USERINFO_CREDENTIAL.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    return _KEYED_CREDENTIAL.sub(_mask, text)


def _redact_value(value: object) -> object:
    """A field value with credentials masked (strings and their containers' reprs)."""
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return redact(value if isinstance(value, str) else str(value))


ContextProvider = Callable[[], Mapping[str, object]]
_context_provider: ContextProvider | None = None


def set_log_context(provider: ContextProvider | None) -> None:
    """Fields every record of this process carries, read from provider when it is made."""
    global _context_provider
    _context_provider = provider


class ContextFilter(logging.Filter):
    """Attaches the process's context fields and the current trace to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always passes the record; adds CONTEXT_ATTR when there is context."""
        context: dict[str, object] = {}
        provider = _context_provider
        if provider is not None:
            try:
                context.update(provider())
            except Exception as exc:  # a log line must never fail for its context
                context["context_error"] = repr(exc)
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid and span_context.trace_flags.sampled:
            context["trace_id"] = format(span_context.trace_id, "032x")
            context["span_id"] = format(span_context.span_id, "016x")
        if context:
            setattr(record, CONTEXT_ATTR, context)
        return True


def context_fields(record: logging.LogRecord) -> dict[str, object]:
    """The context fields attached to a record that its own fields do not already set."""
    context = getattr(record, CONTEXT_ATTR, None)
    if not isinstance(context, Mapping):
        return {}
    own = record_fields(record)
    return {key: value for key, value in context.items() if key not in own}


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
    handler.addFilter(ContextFilter())
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False):
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(config.level)
    grpc_log.install()


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
        message = record.getMessage()
        parts.append(message)
        parts.extend(f"{key}={_text_value(value)}" for key, value in record_fields(record).items())
        parts.extend(
            f"{key}={_text_value(value)}"
            for key, value in context_fields(record).items()
            if f"{key}=" not in message
        )
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return redact(line)


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
            "msg": redact(record.getMessage()),
        }
        for key, value in (context_fields(record) | record_fields(record)).items():
            if _KEYED_CREDENTIAL.fullmatch(f"{key}=x") is not None:
                value = REDACTED
            line[f"field_{key}" if key in _JSON_RESERVED_KEYS else key] = _redact_value(value)
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str, ensure_ascii=False)
