"""Logging from library code: the host program decides where it goes.

Code a user's program imports (the client, ``app.control``) must not write to that program's
stdout. Unconfigured, structlog prints every line there, debug ones included. So library modules
log through ``get_logger``: once an entry point has configured structlog (the worker, ``ctl``,
``broker_svc.logging.configure_logging``), a line goes through it as any other; until then it goes
to the standard library's logger of the same name, which has no handler of ours. The host's
``logging`` configuration then decides: nothing below WARNING by default, and warnings on stderr
through Python's last-resort handler, as for any well-behaved library.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import structlog

__all__ = ["LibraryLogger", "get_logger"]

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
