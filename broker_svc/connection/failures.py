"""Reading pika's failures: why a connection attempt failed, whether retrying can help, size refusals.

pika wraps the cause of a failed attempt in layers of its own exceptions (a connection workflow
keeps them in ``args``), and RabbitMQ states a message-size refusal only in its reply text. The
blocking clients (``connection.py``, the control client) both report and classify failures with
these; they are separate from the I/O thread because they only read exceptions and do no I/O.
"""

from __future__ import annotations

import re
import ssl

import pika.exceptions

__all__ = ["describe_connect_error", "is_permanent", "max_message_size", "missing_exchange"]


# An OpenSSL error as text: with TLS 1.3 the server's refusal of our certificate arrives after the
# handshake, so pika reports it as a lost stream whose message holds the alert.
_TLS_ERROR_TEXT = re.compile(r"\[SSL: ([A-Z0-9_]+)\] ([^(']+?) \(_ssl")
# RabbitMQ's text when a message is over its ``max_message_size`` (406 on the channel).
_MAX_SIZE_TEXT = re.compile(r"larger than configured max size (\d+)")


def _causes(error: BaseException | str) -> list[BaseException | str]:
    """``error`` and the exceptions pika wrapped in it (a connection workflow keeps them in args)."""
    found: list[BaseException | str] = [error]
    index = 0
    while index < len(found):
        item = found[index]
        index += 1
        if isinstance(item, BaseException):
            # pika's connection workflow keeps a list (``exceptions``), each phase one (``exception``).
            wrapped = [*item.args, *getattr(item, "exceptions", ()), getattr(item, "exception", None)]
            found.extend(a for a in wrapped if isinstance(a, BaseException) and a not in found)
            if item.__cause__ is not None and item.__cause__ not in found:
                found.append(item.__cause__)
    return found


def is_permanent(error: BaseException | str) -> bool:
    """Wrong credentials, vhost or TLS setup: retrying the same way cannot succeed."""
    for cause in _causes(error):
        if isinstance(
            cause, pika.exceptions.ProbableAuthenticationError | pika.exceptions.ProbableAccessDeniedError
        ):
            return True
        if isinstance(cause, pika.exceptions.ConnectionClosedByBroker) and cause.reply_code in (403, 530):
            return True
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLEOFError):
            return True  # certificate refused, on either side
    return _tls_alert(error) is not None


def _tls_alert(error: BaseException | str) -> str | None:
    """The OpenSSL reason (``tlsv13 alert certificate required``) a failure's text carries, if any."""
    for cause in _causes(error):
        text = cause if isinstance(cause, str) else f"{cause!s} {cause!r}"
        found = _TLS_ERROR_TEXT.search(text)
        if found and ("ALERT" in found.group(1) or "VERIFY" in found.group(1)):
            return found.group(2).strip()
    return None


def describe_connect_error(error: BaseException | str) -> str:
    """One readable line for a failed connection attempt: the innermost cause pika wrapped."""
    causes = _causes(error)
    for cause in reversed(causes):
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLEOFError):
            return f"TLS handshake failed: {cause}"
    alert = _tls_alert(error)
    if alert is not None:
        return f"TLS handshake failed: {alert}"
    inner = causes[-1]
    if any(_tls_eof(cause) for cause in causes):
        # With TLS 1.3 a broker that refuses our certificate may close the stream before its alert
        # is read: all that is left is an EOF on the TLS stream, which is still worth naming.
        shown = f"{type(inner).__name__}: {inner}" if isinstance(inner, BaseException) else str(inner)
        return f"TLS connection closed by the broker (was a client certificate required?): {shown}"
    if isinstance(inner, BaseException):
        return f"{type(inner).__name__}: {inner}"
    return str(inner)


def _tls_eof(cause: BaseException | str) -> bool:
    if isinstance(cause, ssl.SSLEOFError):
        return True
    return "SSLEOFError" in (cause if isinstance(cause, str) else f"{cause!s} {cause!r}")


def max_message_size(reason: BaseException) -> int | None:
    """The broker's ``max_message_size`` when it closed a channel for a message over it."""
    if not isinstance(reason, pika.exceptions.ChannelClosedByBroker) or reason.reply_code != 406:
        return None
    found = _MAX_SIZE_TEXT.search(str(reason.reply_text))
    return int(found.group(1)) if found else None


# RabbitMQ's text when a message is published to an exchange that does not exist (404).
_NO_EXCHANGE = re.compile(r"no exchange '([^']*)'")


def missing_exchange(reason: BaseException) -> str | None:
    """The exchange named by a channel close for publishing to an exchange that does not exist."""
    if not isinstance(reason, pika.exceptions.ChannelClosedByBroker) or reason.reply_code != 404:
        return None
    found = _NO_EXCHANGE.search(str(reason.reply_text))
    return found.group(1) if found else None
