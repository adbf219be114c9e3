"""The worker's broker connection: aio-pika's robust connection with failover, backoff and TLS.

``connect`` waits for a broker that is not up yet (a worker started before its broker retries with
backoff instead of exiting), and the connection it returns moves on to the next URL of a failover
list whenever a connection is lost or an attempt fails.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import structlog
from yarl import URL

from broker_svc.errors import BrokerUnavailable
from broker_svc.settings import Settings, redact_url

__all__ = ["FailoverConnection", "connect", "describe_error", "one_time_channel", "worker_urls"]

log = structlog.get_logger(__name__)

_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 10.0


def worker_urls(settings: Settings, *, heartbeat_s: float | None = None) -> list[str]:
    """Each broker URL as aio-pika reads it: kombu's vhost spelling (``//`` is ``/``), a heartbeat.

    The heartbeat (``?heartbeat=``) is ``heartbeat_s`` if given, else one already in the URL, else
    ``Settings.heartbeat_s`` (aio-pika's own default would be 60 s).
    """
    path = "/" + quote(settings.virtual_host, safe="")
    urls = []
    for url in settings.broker_urls:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        if heartbeat_s is not None:
            query["heartbeat"] = str(heartbeat_s)
        else:
            query.setdefault("heartbeat", str(settings.heartbeat_s))
        urls.append(urlunsplit(parts._replace(path=path, query=urlencode(query))))
    return urls


def _tls_error(error: BaseException) -> ssl.SSLError | None:
    # aiormq raises AMQPConnectionError from the ssl module's error.
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, ssl.SSLEOFError):
            return seen
        seen = seen.__cause__
    return None


def describe_error(error: BaseException) -> str:
    """One line for a failed attempt, without the URL (aiormq puts the password in some)."""
    tls = _tls_error(error)
    if tls is not None:
        return f"TLS handshake failed: {tls.reason or type(tls).__name__} ({tls})"
    if isinstance(
        error, aiormq.exceptions.ProbableAuthenticationError | aiormq.exceptions.AMQPConnectionError
    ):
        return f"{type(error).__name__}: {_first_text(error)}"
    if isinstance(error, TimeoutError):
        return "TimeoutError: no answer within the connect timeout"
    if isinstance(error, OSError):
        return f"{type(error).__name__}: {error.strerror or error}"
    return f"{type(error).__name__}: {_first_text(error)}"


def _first_text(error: BaseException) -> str:
    text = next((a for a in error.args if isinstance(a, str)), "")
    return redact_url(text) if "@" in text else text


def vhost_refused(error: BaseException) -> bool:
    """The broker closed the connection as it opened the vhost: no such vhost, or no permission on it.

    RabbitMQ answers ``connection.open`` with ``connection.close`` (530 NOT_ALLOWED); aiormq keeps
    only the frame's repr in the error it raises, so the error is recognised by that.
    """
    return isinstance(error, aiormq.exceptions.InvalidFrameError) and "got <Connection.Close" in _first_text(
        error
    )


def is_permanent(error: BaseException) -> bool:
    """Wrong credentials, certificates or vhost: retrying the same way cannot succeed."""
    return (
        _tls_error(error) is not None
        or isinstance(error, aiormq.exceptions.ProbableAuthenticationError)
        or vhost_refused(error)
    )


def _refusal(error: BaseException, url: str) -> str:
    # What a permanent refusal means, naming what was refused (never the password).
    parts = urlsplit(url)
    if vhost_refused(error):
        vhost = unquote(parts.path[1:]) or "/"
        return (
            f"the broker refused vhost {vhost!r}: it does not exist, or user {parts.username!r} has no "
            "permission on it (rabbitmqctl list_vhosts, list_user_permissions)"
        )
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        return f"the broker refused the login of user {parts.username!r}: {describe_error(error)}"
    return describe_error(error)


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection that moves to the next URL after each lost connection or failed attempt.

    aio-pika reconnects to ``self.url``; a failed attempt and a lost connection both end in
    ``_on_connection_close``, so that is where the next URL is chosen. The pause between attempts
    grows from 0.5 s to 10 s and starts over once connected.
    """

    def __init__(self, urls: Sequence[str], **kwargs: Any) -> None:
        self._urls = [URL(u) for u in urls]
        self._name = (kwargs.get("client_properties") or {}).get("connection_name")
        self._index = 0
        self._failures = 0
        super().__init__(self._urls[0], **kwargs)

    @property
    def reconnect_interval(self) -> float:
        if self._failures == 0:
            return _BACKOFF_START_S
        return float(min(_BACKOFF_START_S * 2 ** (self._failures - 1), _BACKOFF_MAX_S))

    @reconnect_interval.setter
    def reconnect_interval(self, _value: float) -> None:
        pass  # aio-pika's fixed interval from the URL; ours backs off

    async def _on_connected(self) -> None:
        self._failures = 0
        await super()._on_connected()

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        await super()._on_connection_close(closing)
        if self._close_called or self.is_closed or not self.connection_attempt:
            return  # closed by us, or the first attempt (``connect`` reports and retries that one)
        self._failures += 1
        error = closing.exception() if not closing.cancelled() else None
        if len(self._urls) > 1:
            self._index = (self._index + 1) % len(self._urls)
            self.url = self._urls[self._index]
        log.warning(
            "broker_connection_lost",
            connection=self._name,  # which of the worker's connections (a 541 should close only its own)
            next_url=redact_url(str(self.url)),
            retry_in_s=self.reconnect_interval,
            error=describe_error(error) if error is not None else None,
        )


async def connect(
    settings: Settings,
    *,
    connection_name: str,
    heartbeat_s: float | None = None,
    stop: asyncio.Event | None = None,
) -> aio_pika.abc.AbstractRobustConnection:
    """Connect to the first broker of ``settings.broker_urls`` that answers, waiting if none does.

    Unreachable brokers are retried with backoff (0.5 s doubling to 10 s) for as long as it takes;
    refused credentials or certificates on every URL end the wait with an error.

    Args:
        settings: broker URLs, TLS options and the connect timeout.
        connection_name: the name shown by ``rabbitmqctl list_connections``.
        heartbeat_s: the AMQP heartbeat, over the URL's and ``settings.heartbeat_s``.
        stop: ends the wait early (a worker told to stop while its broker is down).

    Raises:
        BrokerUnavailable: every URL refused the login or the TLS handshake, or ``stop`` was set.
        ConfigurationError: the TLS files cannot be loaded.
    """
    urls = worker_urls(settings, heartbeat_s=heartbeat_s)
    # aiormq uses the context only for amqps:// URLs, so one serves a mixed list.
    context = next((c for c in map(settings.tls_context, settings.broker_urls) if c is not None), None)
    attempt = 0
    refused: dict[int, str] = {}
    while True:
        index = attempt % len(urls)
        connection = FailoverConnection(
            urls[index:] + urls[:index],
            ssl_context=context,
            client_properties={"connection_name": connection_name},
        )
        try:
            await _until_stopped(connection.connect(timeout=settings.connect_timeout_s), stop)
            if attempt:
                log.info("broker_connected", url=redact_url(urls[index]), attempts=attempt + 1)
            return connection
        except asyncio.CancelledError:
            await connection.close()
            raise
        except (*aio_pika.exceptions.CONNECTION_EXCEPTIONS, TimeoutError) as exc:
            await connection.close()
            if isinstance(exc, _Stopped):
                raise BrokerUnavailable("stopped while waiting for the broker") from None
            reason = describe_error(exc)
            if is_permanent(exc):
                reason = _refusal(exc, urls[index])
                refused[index] = reason
                if len(refused) == len(urls):
                    log.error("broker_connect_refused", url=settings.safe_broker_url, error=reason)
                    raise BrokerUnavailable(
                        f"broker {settings.safe_broker_url} refused the connection: {reason}"
                    ) from None
            else:
                refused.pop(index, None)
            attempt += 1
            delay = min(_BACKOFF_START_S * 2 ** ((attempt - 1) // len(urls)), _BACKOFF_MAX_S)
            log.warning("broker_connect_failed", url=redact_url(urls[index]), error=reason, retry_in_s=delay)
            try:
                await _until_stopped(asyncio.sleep(delay), stop)
            except _Stopped:
                raise BrokerUnavailable("stopped while waiting for the broker") from None


async def one_time_channel(
    connection: aio_pika.abc.AbstractRobustConnection, *, publisher_confirms: bool = False
) -> aio_pika.abc.AbstractChannel:
    """A channel on ``connection`` that aio-pika never reopens, for a subscriber that renews itself.

    A robust channel closed by the broker (a 406) or by a lost connection is reopened with its
    consumers and QoS, but not its transaction mode, and the subscriber that owned it knows
    nothing of it: beside the subscriber's own new channel it keeps consuming into the same
    callbacks, acking outside any transaction, and can hold a single-active-consumer slot.

    Raises:
        aiormq.exceptions.AMQPError: the channel could not be opened (the connection is down).
    """
    await connection.ready()
    return await aio_pika.Channel(connection, publisher_confirms=publisher_confirms)


class _Stopped(RuntimeError):
    """``stop`` was set while connecting (a RuntimeError, as aio-pika's connection errors are)."""


async def _until_stopped(work: Any, stop: asyncio.Event | None) -> None:
    if stop is None:
        await work
        return
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # our caller was cancelled: its attempt must not go on (and connect) alone
        raise
    finally:
        stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _Stopped("stop requested")
    task.result()
