"""pamqp's one swapped internal: header ints encoded as Celery's peers read them (the whole process)."""

from __future__ import annotations

import pamqp.encode

__all__ = ["install_header_int_guard"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _table_integer(value: int) -> bytes:
    # pamqp picks the smallest int type ('b', 's', 'u'); py-amqp before 5.4.2 reads 's' as a
    # short string and mangles the headers (WIRE.md §2.2). Celery and pika always send 'I' or 'l'.
    if _INT32_MIN <= value <= _INT32_MAX:
        return b"I" + pamqp.encode.long_int(value)
    return b"l" + pamqp.encode.long_long_int(value)


def install_header_int_guard() -> None:
    """Make pamqp encode header ints as 32-bit ``I`` (or 64-bit ``l``), as py-amqp and pika do.

    This replaces ``pamqp.encode.table_integer``, a module global pamqp looks up on every call,
    so it changes every AMQP table the *whole process* encodes with pamqp (aio-pika, aiormq), not
    only the worker's. Calling it again does nothing. The worker calls it at start-up;
    ``tests/unit/test_private_internals.py`` pins that pamqp still routes ints through it.
    """
    if pamqp.encode.table_integer is not _table_integer:
        pamqp.encode.table_integer = _table_integer
