"""Logging: structlog's set-up for entry points, and the logger library code writes to.

``configure_logging`` is called by entry points only (the worker, ``ctl``, tests).

Code a user's program imports (the client, ``app.control``) must not write to that program's
stdout. Unconfigured, structlog prints every line there, debug ones included. So library modules
log through ``get_logger``: once an entry point has configured structlog, a line goes through it as
any other; until then it goes to the standard library's logger of the same name, which has no
handler of ours. The host's ``logging`` configuration then decides: nothing below WARNING by
default, and warnings on stderr through Python's last-resort handler, as for any well-behaved
library.

structlog is imported only to configure it or to write through it: with the asyncio it imports,
it is about 35 ms to load, more than ``ctl inspect ping`` takes on the wire, and a short command
configured with ``defer=True`` loads it only if it writes a line.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Final, TextIO

if TYPE_CHECKING:
    import structlog

__all__ = ["HotLogger", "LibraryLogger", "configure_logging", "get_logger"]


def configure_logging(
    level: str | int = "INFO", *, json: bool | None = None, cache: bool = True, defer: bool = False
) -> None:
    """Route structlog and the stdlib (pika, aio-pika, aiormq) through one renderer.

    Args:
        level: minimum level, a name (``"info"``) or a number.
        json: JSON lines (default when stderr is not a terminal) or the console renderer.
        cache: cache loggers on first use (turn off in tests, so ``capture_logs`` works).
        defer: set the levels now, but structlog and the renderer up only when the first line at
            ``level`` or above is written (through ``get_logger`` or the stdlib), which then goes
            out as it would have; for short commands that mostly write none (``ctl``).

    Raises:
        ValueError: an unknown level name.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    root = logging.getLogger()
    if defer:
        root.handlers[:] = [_SetUpOnFirstRecord(numeric, json=json, cache=cache)]
    else:
        root.handlers[:] = [_set_up(numeric, json=json, cache=cache)]
    root.setLevel(numeric)
    # The AMQP clients log every reconnect attempt at INFO with tracebacks; ours say it once.
    for noisy in ("pika", "aio_pika", "aiormq"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def _set_up(level: int, *, json: bool | None, cache: bool) -> logging.Handler:
    # structlog configured; returns the root logger's handler, which renders the stdlib's records.
    import structlog

    use_json = (not sys.stderr.isatty()) if json is None else json
    stamper = _UtcStamper()
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        stamper,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_JsonLines())
        if use_json
        else structlog.dev.ConsoleRenderer()
    )
    # On a terminal a task's traceback is read, not parsed: below its line, as Python prints it,
    # not one escaped line of 600 characters. JSON keeps it one field of one line.
    render_exception = structlog.processors.format_exc_info if use_json else _traceback_below
    # In JSON the shared steps and the renderer are one processor for our own events (the worker
    # writes a line per task): the same fields in the same order, at about half the cost.
    own: list[structlog.types.Processor] = (
        [_JsonLine(stamper)] if use_json else [*shared, render_exception, renderer]
    )
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
        processors=own,
        logger_factory=_HandlerLoggerFactory(handler),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=cache,
    )
    return handler


class _SetUpOnFirstRecord(logging.Handler):
    """The root logger's handler until the first line is written (``configure_logging(defer=True)``).

    ``set_up`` puts the real handler in its place and configures structlog; a stdlib record that
    arrives here is handed on to it. ``LibraryLogger`` calls ``set_up`` itself before its first
    line, so that line goes through structlog as it would have, not as a stdlib record.
    """

    def __init__(self, level: int, *, json: bool | None, cache: bool) -> None:
        super().__init__()
        self._settings = (level, json, cache)

    def set_up(self) -> None:
        level, json, cache = self._settings
        root = logging.getLogger()
        handler = _set_up(level, json=json, cache=cache)
        root.handlers[:] = [handler if h is self else h for h in root.handlers]

    def emit(self, record: logging.LogRecord) -> None:
        self.set_up()
        for handler in logging.getLogger().handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _set_up_deferred() -> bool:
    # Whether a deferred set-up was pending (it is done now).
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _SetUpOnFirstRecord):
            handler.set_up()
            return True
    return False


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


class _JsonLine:
    """The shared processors and the JSON renderer in one, for our own events.

    The same steps in the same order as ``shared``, ``format_exc_info`` and the renderer: the
    bound context first (``merge_contextvars``), then ``level``, ``logger``, ``timestamp``, a stack
    or an exception when asked for, and the JSON line of ``json.dumps`` with structlog's fallback
    for other types. What it saves is per line: one call instead of seven, the context read from
    structlog's own variables rather than from a copy of every variable of the context, and the
    common values (strings, ints, floats, None, booleans) rendered without the encoder.
    """

    def __init__(self, stamper: _UtcStamper) -> None:
        import structlog  # made by _set_up, which imports it

        self._stamper = stamper
        # structlog's frames are skipped when it looks for the caller's; ours too, as we call it.
        self._stack = structlog.processors.StackInfoRenderer(additional_ignores=[__name__])
        # structlog's JSONRenderer default: what the encoder cannot take, by ``__structlog__`` or repr.
        self._encoder = json.JSONEncoder(
            default=getattr(structlog.processors, "_json_fallback_handler", repr)
        )
        self._variables: dict[str, Any] | None = getattr(structlog.contextvars, "_CONTEXT_VARS", None)
        self._prefix_length = len(getattr(structlog.contextvars, "STRUCTLOG_KEY_PREFIX", "structlog_"))
        self._merge = structlog.contextvars.merge_contextvars
        self._format_exc_info = structlog.processors.format_exc_info

    def __call__(self, logger: Any, method_name: str, event_dict: structlog.types.EventDict) -> str:
        variables = self._variables
        if variables is None:  # a structlog without its table of variables: its own merge
            self._merge(logger, method_name, event_dict)
        else:
            # Copied first: a thread binding a new name adds to it meanwhile.
            prefix = self._prefix_length
            for name, variable in tuple(variables.items()):
                value = variable.get()
                if value is not Ellipsis:
                    event_dict.setdefault(name[prefix:], value)
        event_dict["level"] = _METHOD_LEVELS.get(method_name, method_name)
        record = event_dict.get("_record")
        event_dict["logger"] = logger.name if record is None else record.name
        event_dict = self._stamper(logger, method_name, event_dict)
        if "stack_info" in event_dict:
            event_dict = self._stack(logger, method_name, event_dict)
        if "exc_info" in event_dict:
            event_dict = self._format_exc_info(logger, method_name, event_dict)
        return self._render(event_dict)

    def _render(self, event_dict: structlog.types.EventDict) -> str:
        # ``json.dumps``'s output for the dict, value by value; the encoder for anything else.
        parts = []
        encode = self._encoder.encode
        for key, value in event_dict.items():
            if type(key) is not str:
                return encode(event_dict)
            kind = type(value)
            if kind is str:
                text = _quote(value)
            elif kind is int:
                text = int.__repr__(value)
            elif kind is float and value == value and value not in _INFINITIES:
                text = float.__repr__(value)
            elif value is None:
                text = "null"
            elif value is True:
                text = "true"
            elif value is False:
                text = "false"
            else:
                text = encode(value)
            parts.append(f"{_quote(key)}: {text}")
        return "{" + ", ".join(parts) + "}"


_METHOD_LEVELS: Final = {"warn": "warning", "exception": "error"}  # structlog's add_log_level
_INFINITIES: Final = (float("inf"), float("-inf"))
_quote: Final = json.encoder.encode_basestring_ascii


def _traceback_below(
    _logger: object, _name: str, event_dict: structlog.types.EventDict
) -> structlog.types.EventDict:
    # A ``traceback`` field (a task's, as text) goes where the console renderer prints an
    # exception: after the line, as it was written. One the call also has is left as a field.
    text = event_dict.get("traceback")
    if isinstance(text, str) and "exception" not in event_dict and "exc_info" not in event_dict:
        event_dict["exception"] = event_dict.pop("traceback").rstrip("\n")
    return event_dict


class _HandlerLogger:
    """Writes rendered structlog lines to a stdlib handler's stream, under the handler's lock.

    Sharing the lock keeps our lines and the stdlib's (pika, aio-pika, aiormq) whole when they
    are written from different threads.
    """

    def __init__(self, name: str, handler: logging.StreamHandler[TextIO]) -> None:
        self.name = name  # ``add_logger_name`` reads it
        self._handler = handler
        self._direct = _direct_file(handler.stream)

    def msg(self, message: str) -> None:
        handler = self._handler
        try:
            with handler.lock or contextlib.nullcontext():
                stream = handler.stream
                direct = self._direct
                if direct is not None and direct[0] is stream:
                    # Straight to the file: the stream's buffer is empty (every writer flushes,
                    # and a flush first covers one that did not), and the line is ASCII.
                    stream.flush()
                    data = (message + handler.terminator).encode()
                    while data:
                        data = data[os.write(direct[1], data) :]
                else:
                    stream.write(message + handler.terminator)
                    stream.flush()
        except Exception:  # as the stdlib's handlers: a line that cannot be written never fails its caller
            pass

    debug = info = warning = warn = error = err = critical = exception = fatal = failure = log = msg


def _direct_file(stream: TextIO) -> tuple[TextIO, int] | None:
    # The stream and its file descriptor, when a line may be written to the descriptor itself: a
    # text stream over a file, in an encoding that writes ASCII as ASCII. Else None (a test's
    # capture, a stream without a descriptor): written through the stream.
    try:
        fd = stream.fileno()
        encoding = codecs.lookup(stream.encoding).name
    except (AttributeError, OSError, LookupError, TypeError, ValueError):
        return None
    return (stream, fd) if encoding in _ASCII_SUPERSETS else None


_ASCII_SUPERSETS: Final = frozenset({"utf-8", "ascii", "latin-1", "iso8859-1", "cp1252"})


class _HandlerLoggerFactory:
    def __init__(self, handler: logging.StreamHandler[TextIO]) -> None:
        import structlog

        self._handler = handler
        self._find_name = structlog.stdlib.LoggerFactory(ignore_frame_names=[__name__])

    def __call__(self, *args: Any) -> _HandlerLogger:
        # ``get_logger(__name__)`` passes the name; without one, the stdlib factory finds the caller.
        if args and isinstance(args[0], str):
            return _HandlerLogger(args[0], self._handler)
        return _HandlerLogger(self._find_name().name, self._handler)


class HotLogger:
    """A module's logger for a line written once per task: structlog's, without its proxy per call.

    ``structlog.get_logger`` returns a proxy that builds (or, once cached, finds) the bound logger
    on every call, through ``__getattr__``: about a third of a line's cost. This one keeps the
    bound logger once structlog has cached it (``cache_logger_on_first_use``, as the worker
    configures it) and asks the proxy each time otherwise, so ``capture_logs`` in tests sees its
    lines as any other's.
    """

    __slots__ = ("_bound", "_proxy")

    def __init__(self, name: str) -> None:
        import structlog  # a worker's modules make these; a worker configures structlog anyway

        self._proxy = structlog.get_logger(name)
        self._bound: Any = None

    def info(self, event: str, **fields: Any) -> None:
        (self._bound or self._resolve()).info(event, **fields)

    def _resolve(self) -> Any:
        bound = self._proxy.bind()
        if "bind" in vars(self._proxy):  # structlog cached it: its later calls return this one
            self._bound = bound
        return bound


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

    __slots__ = ("_name", "_stdlib", "_structlog")

    def __init__(self, name: str) -> None:
        self._name = name
        self._structlog: Any = None  # structlog's logger, made on the first line through structlog
        self._stdlib = logging.getLogger(name)

    def _emit(self, method: str, event: str, fields: dict[str, Any]) -> None:
        # Not imported means not configured: structlog is loaded only by whoever configures it.
        structlog = sys.modules.get("structlog")
        if structlog is None or not structlog.is_configured():
            level = _LEVELS[method]
            if not self._stdlib.isEnabledFor(level):
                return
            if not _set_up_deferred():
                exc_info = fields.pop("exc_info", method == "exception")
                text = " ".join([event, *(f"{key}={value!r}" for key, value in fields.items())])
                self._stdlib.log(level, "%s", text, exc_info=exc_info)
                return
            structlog = sys.modules["structlog"]
        if self._structlog is None:
            self._structlog = structlog.get_logger(self._name)
        getattr(self._structlog, method)(event, **fields)

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
