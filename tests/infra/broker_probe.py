"""Reachability checks for AMQP brokers and free ports; stdlib only, no login attempted."""

from __future__ import annotations

import socket
import ssl
from urllib.parse import quote, urlsplit, urlunsplit

LOCAL_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"
"""The shared local broker. One slash: pika reads ``//`` as the empty vhost, not ``/``."""

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})

_AMQP_PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME_METHOD = 1  # Connection.Start arrives as a method frame


def broker_reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Tell whether an AMQP 0-9-1 server answers at the URL's host and port.

    Sends the protocol header and checks that the server replies with a method frame
    (Connection.Start); no login is attempted. ``amqps`` URLs get a TLS handshake first.

    Args:
        url: AMQP URL; only scheme, host and port are used.
        timeout_s: Bound on each network step (connect, TLS, reply).

    Returns:
        True if a Connection.Start frame came back.
    """
    try:
        parts = urlsplit(url)
        tls = parts.scheme == "amqps"
        host = parts.hostname or "localhost"
        port = parts.port or (5671 if tls else 5672)
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            if not tls:
                return _answers_connection_start(raw)
            context = ssl.create_default_context()
            with context.wrap_socket(raw, server_hostname=host) as wrapped:
                return _answers_connection_start(wrapped)
    except (OSError, ValueError):  # ValueError: malformed port in the URL
        return False


def _answers_connection_start(sock: socket.socket) -> bool:
    sock.sendall(_AMQP_PROTOCOL_HEADER)
    first = sock.recv(1)
    # A server that does not speak 0-9-1 answers with its own b"AMQP..." header instead.
    return first == bytes([_FRAME_METHOD])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Tell whether ``port`` can be bound on ``host`` right now.

    Args:
        port: TCP port.
        host: Interface address.

    Returns:
        True if a bind succeeded.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def url_with_vhost(url: str, vhost: str) -> str:
    """Return ``url`` with its path replaced by the URL-quoted ``vhost``.

    Args:
        url: AMQP URL.
        vhost: Virtual host name, unquoted.

    Returns:
        The new URL.
    """
    return urlunsplit(urlsplit(url)._replace(path="/" + quote(vhost, safe="")))


def redact_url(url: str) -> str:
    """Return ``url`` with its password replaced by ``***``, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
