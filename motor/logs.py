"""Logging set-up shared by every motor process (docs/observability.md).

Two formats, chosen by ``motor --log-format`` or ``MOTOR_LOG_FORMAT`` (``motor up`` passes
it on to every child process through the environment):

* ``text`` (default): ``<time> LEVEL logger[pid]: message``, with `` [request <id>]`` after
  the logger name in lines logged while a request is served;
* ``json``: one JSON object a line: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``pid``,
  ``msg``, ``request_id`` when there is one, ``exc`` with a traceback, and the fields of
  an access log line (``extra={"access": {...}}``) merged in.

The request id comes from :data:`REQUEST_ID`, a context variable the coordinator sets while
it serves a request (when ``coordinator.access_log`` or tracing is on), read by a
:class:`RequestIdFilter` on the handler: every line logged by that request's task (and
the tasks it starts) carries it.
"""
from __future__ import annotations

import datetime
import logging
import os
from contextvars import ContextVar
from typing import Any

import orjson

#: the id of the request the current task serves (``None`` outside a request)
REQUEST_ID: ContextVar[str | None] = ContextVar("motor_request_id", default=None)

FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s[%(process)d]%(request_tag)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` (the current :data:`REQUEST_ID` or ``None``) and
    ``record.request_tag`` (`` [request <id>]`` or ``""``) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request_id = rid
        record.request_tag = f" [request {rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "pid": record.process,
            "msg": record.getMessage()}
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            for k, v in access.items():
                out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return orjson.dumps(out, default=str).decode()


def log_format(fmt: str | None = None) -> str:
    """``fmt``, else ``MOTOR_LOG_FORMAT``, else ``text``; raises ValueError for another name."""
    fmt = fmt or os.environ.get("MOTOR_LOG_FORMAT") or "text"
    fmt = fmt.strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format is expected to be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def make_handler(fmt: str = "text", stream: Any = None) -> logging.Handler:
    """A stream handler (stderr by default) in ``fmt`` with the request-id filter."""
    h = logging.StreamHandler(stream)
    h.addFilter(RequestIdFilter())
    h.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    return h


def setup_logging(level: str = "info", fmt: str | None = None) -> None:
    """Configure the root logger once on stderr, in ``fmt`` (:func:`log_format`).

    ``MOTOR_LOG_LEVEL`` in the environment overrides ``level`` (used by
    ``motor up`` to pass one level to every child process); an explicit ``fmt`` is put in
    ``MOTOR_LOG_FORMAT`` so that child processes log in the same format.
    """
    level = os.environ.get("MOTOR_LOG_LEVEL", level)
    if fmt:
        os.environ["MOTOR_LOG_FORMAT"] = log_format(fmt)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        handlers=[make_handler(log_format(fmt))])
