"""A blocking pika connection to the first broker URL that opens, its failures as ``BrokerUnavailable``.

pika tries a failover list in turn and raises, when none opens, the last attempt's error: an
``AMQPError`` or an ``OSError``, but also its connector's own exceptions (a broker that takes the
connection and never answers ends in ``AMQPConnectorStackTimeout``), which are neither. The
blocking clients (the control client, ``ctl dead``, the scheduler's journal, the beat's events)
open their connections here so that every one of those reaches the caller as one typed error.
"""

from __future__ import annotations

import pika
import pika.exceptions
from pika.adapters.utils.connection_workflow import AMQPConnectorException

from broker_svc.connection.failures import describe_connect_error
from broker_svc.connection.parameters import all_connection_parameters
from broker_svc.errors import BrokerUnavailable
from broker_svc.settings import Settings

__all__ = ["CONNECT_ERRORS", "open_blocking"]

# What pika raises when no URL of the list opened.
CONNECT_ERRORS = (pika.exceptions.AMQPError, AMQPConnectorException, OSError)


def open_blocking(settings: Settings, *, connection_name: str) -> pika.BlockingConnection:
    """A connection to the first of ``settings.broker_urls`` that opens, named ``connection_name``.

    Raises:
        BrokerUnavailable: none opened; the message names the broker (password hidden) and why.
    """
    try:
        return pika.BlockingConnection(all_connection_parameters(settings, connection_name=connection_name))
    except CONNECT_ERRORS as exc:
        raise BrokerUnavailable(f"broker {settings.safe_broker_url}: {describe_connect_error(exc)}") from exc
