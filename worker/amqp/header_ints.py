"""Wire guards for what the worker publishes with aio-pika (pamqp) to Celery peers."""

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

    pamqp looks ``table_integer`` up as a module global on every call, so replacing it is enough;
    the worker calls this once at start-up.
    """
    pamqp.encode.table_integer = _table_integer
