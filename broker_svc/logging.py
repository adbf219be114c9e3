"""structlog set-up, called by entry points only (worker, ``ctl``, tests)."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging"]


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
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=cache,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if use_json else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # The AMQP clients log every reconnect attempt at INFO with tracebacks; ours say it once.
    for noisy in ("pika", "aio_pika", "aiormq"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def _identity(
    _logger: object, _name: str, event_dict: structlog.types.EventDict
) -> structlog.types.EventDict:
    return event_dict
