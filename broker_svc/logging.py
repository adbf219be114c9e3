"""Logging: structlog's set-up for entry points, and the logger library code writes to.

``configure_logging`` is called by entry points only (the worker, ``ctl``, tests).

Code a user's program imports (the client, ``app.control``) must not write to that program's
stdout. Unconfigured, structlog prints every line there, debug ones included. So library modules
log through ``get_logger``: once an entry point has configured structlog, a line goes through it as
any other; until then it goes to the standard library's logger of the same name, which has no
handler of ours. The host's ``logging`` configuration then decides: nothing below WARNING by
default, and warnings on stderr through Python's last-resort handler, as for any well-behaved
library.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from typing import Any, Final, TextIO

import structlog

__all__ = ["LibraryLogger", "configure_logging", "get_logger"]


def configure_logging(level: str | int = "INFO", *, json: bool | None = None, cache: bool = True) -> None:
    """Route structlog and the stdlib (pika, aio-pika, aiormq) through one renderer.

    Args:
        level: minimum level, a name (``"info"``) or a number.
        json: JSON lines (default when stderr is not a terminal) or the console renderer.
        cache: cache loggers on first use (turn off in tests, so ``capture_logs`` works).
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    use_json = (not sys.stderr.isatty()) if json is None else json
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _UtcStamper(),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_JsonLines())
        if use_json
        else structlog.dev.ConsoleRenderer()
    )
    render_exception = structlog.processors.format_exc_info if use_json else _identity
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                render_exception,
                renderer,
            ],
        )
    )
    # Our own events skip the stdlib (a LogRecord, the handler's filters and the formatter cost
    # about half of each line, and the worker writes one per task): the same processors render
    # them here, and they are written to the same stream under the handler's lock.
    structlog.configure(
        processors=[*shared, render_exception, renderer],
        logger_factory=_HandlerLoggerFactory(handler),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=cache,
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # The AMQP clients log every reconnect attempt at INFO with tracebacks; ours say it once.
    for noisy in ("pika", "aio_pika", "aiormq"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


class _UtcStamper:
    """``timestamp`` as structlog's ISO UTC stamper writes it (``2026-11-25T06:30:00.123456Z``).

    The worker writes a line per task: the date and time are formatted once a second, not per line.
    """

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")  # one tuple, replaced whole: safe across threads

    def __call__(
        self, _logger: object, _name: str, event_dict: structlog.types.EventDict
    ) -> structlog.types.EventDict:
        now = time.time()
        second, text = self._second
        if int(now) != second:
            second = int(now)
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, text)
        event_dict["timestamp"] = f"{text}.{int((now - second) * 1_000_000):06d}Z"
        return event_dict


class _JsonLines:
    """``json.dumps`` for the renderer, with one encoder for every line instead of one per line.

    The renderer passes the same options (its ``default``) on every call; ``json.dumps`` given any
    option builds a new ``JSONEncoder`` each time, about a quarter of the line's JSON.
    """

    def __init__(self) -> None:
        self._encoder: json.JSONEncoder | None = None

    def __call__(self, obj: Any, **options: Any) -> str:
        encoder = self._encoder
        if encoder is None:
            encoder = self._encoder = json.JSONEncoder(**options)
        return encoder.encode(obj)


def _identity(
    _logger: object, _name: str, event_dict: structlog.types.EventDict
) -> structlog.types.EventDict:
    return event_dict


class _HandlerLogger:
    """Writes rendered structlog lines to a stdlib handler's stream, under the handler's lock.

    Sharing the lock keeps our lines and the stdlib's (pika, aio-pika, aiormq) whole when they
    are written from different threads.
    """

    def __init__(self, name: str, handler: logging.StreamHandler[TextIO]) -> None:
        self.name = name  # ``add_logger_name`` reads it
        self._handler = handler

    def msg(self, message: str) -> None:
        handler = self._handler
        try:
            with handler.lock or contextlib.nullcontext():
                handler.stream.write(message + handler.terminator)
                handler.stream.flush()
        except Exception:  # as the stdlib's handlers: a line that cannot be written never fails its caller
            pass

    debug = info = warning = warn = error = err = critical = exception = fatal = failure = log = msg


class _HandlerLoggerFactory:
    def __init__(self, handler: logging.StreamHandler[TextIO]) -> None:
        self._handler = handler
        self._find_name = structlog.stdlib.LoggerFactory(ignore_frame_names=[__name__])

    def __call__(self, *args: Any) -> _HandlerLogger:
        # ``get_logger(__name__)`` passes the name; without one, the stdlib factory finds the caller.
        if args and isinstance(args[0], str):
            return _HandlerLogger(args[0], self._handler)
        return _HandlerLogger(self._find_name().name, self._handler)


_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
}


class LibraryLogger:
    """structlog's call style (``log.info("event", key=value)``), routed as the module docstring says."""

    __slots__ = ("_stdlib", "_structlog")

    def __init__(self, name: str) -> None:
        self._structlog = structlog.get_logger(name)
        self._stdlib = logging.getLogger(name)

    def _emit(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
            return
        level = _LEVELS[method]
        if not self._stdlib.isEnabledFor(level):
            return
        exc_info = fields.pop("exc_info", method == "exception")
        text = " ".join([event, *(f"{key}={value!r}" for key, value in fields.items())])
        self._stdlib.log(level, "%s", text, exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit("exception", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        self._emit("critical", event, fields)


def get_logger(name: str) -> LibraryLogger:
    """The logger for library module ``name`` (pass ``__name__``)."""
    return LibraryLogger(name)
