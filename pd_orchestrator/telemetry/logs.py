"""The daemons' logs: timestamp, level, logger and the request id on every line.

:func:`configure_logging` installs one handler on the root logger (replacing the
one it installed before), so every library's records -- uvicorn's included -- come
out in one shape:

* ``text``: ``2025-01-31T12:00:00.123Z INFO pd_orchestrator.gateway [<request id>] message``
  (``[-]`` outside a request);
* ``json``: one object per line with ``time``, ``level``, ``logger``, ``message``,
  ``request_id`` (when serving a request), ``exception`` (a traceback) and the
  structured ``fields`` a record carries (``extra={"fields": {...}}``, as the
  access log does).

The request id comes from :data:`REQUEST_ID`, a context variable the gateway sets
when it admits a request: everything that runs for that request (its tasks
included) logs it, and setting it costs nothing when nothing is logged.
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from typing import Any, TextIO

import orjson

from pd_orchestrator.config.observability import LogFormat, LoggingConfig, LogLevel

__all__ = [
    "ACCESS_LOGGER",
    "REQUEST_ID",
    "JsonFormatter",
    "RequestIdFilter",
    "TextFormatter",
    "configure_logging",
    "with_overrides",
]

REQUEST_ID: ContextVar[str | None] = ContextVar("pd_orchestrator_request_id", default=None)
"""The id of the request being served in this context (None outside a request)."""

ACCESS_LOGGER = "pd_orchestrator.access"
"""The logger of the access log (one line per answered request, when enabled)."""

_INSTALLED = "_pd_orchestrator_handler"


def _timestamp(record: logging.LogRecord) -> str:
    seconds = int(record.created)
    millis = int((record.created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (from :data:`REQUEST_ID`) to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <logger> [<request id>] <message>`` (+ traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None) or "-"
        line = (
            f"{_timestamp(record)} {record.levelname} {record.name} "
            f"[{request_id}] {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            document["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                document.setdefault(key, value)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(document, default=str).decode()


def configure_logging(config: LoggingConfig, stream: TextIO | None = None) -> logging.Handler:
    """Send every record at ``config.level`` or above to ``stream`` (default: stderr)
    in ``config.format``; returns the handler (installed on the root logger)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _INSTALLED, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if config.format == "json" else TextFormatter())
    setattr(handler, _INSTALLED, True)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    return handler


def with_overrides(
    config: LoggingConfig, level: LogLevel | None, log_format: LogFormat | None
) -> LoggingConfig:
    """``config`` with the command line's ``--log-level``/``--log-format`` (when given)."""
    update = {k: v for k, v in (("level", level), ("format", log_format)) if v is not None}
    return config.model_copy(update=update) if update else config
