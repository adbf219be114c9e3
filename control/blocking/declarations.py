"""Declaring topology specs over blocking pika: an exchange, a queue with its exchange and binding."""

from __future__ import annotations

from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.topology import ExchangeSpec, QueueSpec

__all__ = ["declare_exchange", "declare_queue"]


def declare_exchange(channel: Channel, spec: ExchangeSpec) -> None:
    """Declare ``spec``'s exchange.

    Raises:
        pika.exceptions.ChannelClosed: the broker refused the declaration.
    """
    channel.exchange_declare(spec.name, exchange_type=spec.type, **spec.declare_options())


def declare_queue(channel: Channel, spec: QueueSpec, *, bind: bool) -> None:
    """Declare ``spec``'s queue; with ``bind``, its exchange and binding too.

    Raises:
        pika.exceptions.ChannelClosed: the broker refused a declaration.
    """
    channel.queue_declare(spec.name, **spec.declare_options())
    if bind and spec.exchange is not None:
        declare_exchange(channel, spec.exchange)
        channel.queue_bind(spec.name, spec.exchange.name, routing_key=spec.routing_key)
