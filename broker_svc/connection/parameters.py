"""pika's parameters for a connection to the broker: URL, vhost, heartbeat, timeouts and TLS.

Both blocking clients connect with these (the publisher's I/O thread in ``connection.py`` and the
control client), each retrying and failing over its own way; they are kept apart from the I/O
thread because building them is pure configuration, with pika only as the type that carries it.
"""

from __future__ import annotations

import pika

from broker_svc.settings import Settings

__all__ = ["all_connection_parameters", "connection_parameters"]


def connection_parameters(
    settings: Settings, *, connection_name: str, url: str | None = None
) -> pika.URLParameters:
    """pika's parameters for one connection attempt to a broker ``settings`` name.

    The vhost comes from ``Settings.virtual_host``, heartbeat and timeouts from their settings,
    TLS from ``Settings.tls_context``; the connection makes one attempt, as each caller retries
    (and fails over) in its own way.

    Args:
        settings: the broker URL(s), TLS options and the connection timeouts.
        connection_name: the name shown by ``rabbitmqctl list_connections``.
        url: which of ``settings.broker_urls`` to connect to (default: the first).

    Raises:
        ValueError: pika rejects the URL (a bad port or query parameter).
        ConfigurationError: the TLS files cannot be loaded.
    """
    url = url or settings.broker_urls[0]
    params = pika.URLParameters(url)
    params.virtual_host = settings.virtual_host  # pika reads "//" as vhost ""
    params.heartbeat = settings.heartbeat_s
    params.socket_timeout = settings.connect_timeout_s
    params.stack_timeout = settings.connect_timeout_s * 2
    # Blocked connections (resource alarms) are timed per publish by BrokerConnection, which keeps
    # the connection so publishing resumes when the alarm clears; the control client uses this.
    params.blocked_connection_timeout = settings.confirm_timeout_s
    params.connection_attempts = 1
    params.client_properties = {"connection_name": connection_name, "product": "clockwork"}
    context = settings.tls_context(url)
    if context is not None:
        params.ssl_options = pika.SSLOptions(context)
    return params


def all_connection_parameters(settings: Settings, *, connection_name: str) -> list[pika.URLParameters]:
    """Parameters for every URL of ``settings.broker_urls``, in failover order.

    Raises:
        ValueError: pika rejects a URL.
        ConfigurationError: the TLS files cannot be loaded.
    """
    return [
        connection_parameters(settings, connection_name=connection_name, url=url)
        for url in settings.broker_urls
    ]
