"""The control client's pika and socket errors as one line a user can act on."""

from __future__ import annotations

import pika.exceptions

__all__ = ["describe_error"]


def describe_error(exc: BaseException) -> str:
    """A pika or socket error as one line a user can act on."""
    if isinstance(exc, pika.exceptions.ProbableAuthenticationError):
        return "authentication failed (check the user name and password)"
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        return "access denied (check the vhost and the user's permissions)"
    if isinstance(exc, pika.exceptions.AMQPConnectionError) and exc.args:
        inner = exc.args[0]
        if isinstance(inner, BaseException):
            return f"cannot connect ({type(inner).__name__}: {inner})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
