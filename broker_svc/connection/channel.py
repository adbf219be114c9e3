"""What the I/O thread does on a pika channel that needs none of the connection's state.

Declaring a queue with its exchange and binding (pika's callback chain), the properties a message
is published with, and turning a consumed message into a ``Delivery`` for a consumer callback.
They are separate from ``io_thread.py`` so that module keeps only the connection's life cycle and
its bookkeeping; like it, this module runs on the I/O thread and imports pika.
"""

from __future__ import annotations

from collections.abc import Callable

import pika
import pika.channel
import pika.frame
import pika.spec

from broker_svc.connection.pending import Delivery, PendingPublish
from broker_svc.connection.pika_internals import EncodedProperties
from broker_svc.logging import get_logger
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_properties

__all__ = ["Consumer", "declare", "delivery_handler", "message_properties"]

log = get_logger(__name__)

Consumer = Callable[[Delivery], None]


def declare(channel: pika.channel.Channel, spec: QueueSpec, on_bound: Callable[[], None]) -> None:
    """Declare a queue (and its exchange and binding); ``on_bound`` runs after the bind-ok.

    pika holds RPCs back while another is in flight but sends publishes at once, so a publish
    must wait for ``on_bound`` rather than rely on channel ordering.
    """
    exchange = spec.exchange

    def bound(_frame: pika.frame.Method | None = None) -> None:
        on_bound()

    def declare_queue(_frame: pika.frame.Method | None = None) -> None:
        channel.queue_declare(
            spec.name, **spec.declare_options(), callback=bind if exchange is not None else bound
        )

    def bind(_frame: pika.frame.Method) -> None:
        assert exchange is not None
        channel.queue_bind(spec.name, exchange.name, routing_key=spec.routing_key, callback=bound)

    if exchange is not None:
        channel.exchange_declare(
            exchange.name, exchange_type=exchange.type, **exchange.declare_options(), callback=declare_queue
        )
    else:
        declare_queue()


def message_properties(pending: PendingPublish) -> pika.BasicProperties:
    """The AMQP properties ``pending`` goes out with (this send's, as a resend is marked).

    Raises:
        TypeError, ValueError: a header or property AMQP cannot carry (``amqp_fields``).
    """
    return EncodedProperties(encode_properties(**pending.property_fields()))


def delivery_handler(callback: Consumer, *, connection_name: str) -> Callable[..., None]:
    """pika's ``on_message_callback`` for ``callback``: a ``Delivery`` each; its errors are logged."""

    def on_message(
        _ch: pika.channel.Channel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        delivery = Delivery(
            body=body,
            content_type=props.content_type,
            correlation_id=props.correlation_id,
            headers=props.headers or {},
            routing_key=method.routing_key,
            redelivered=bool(method.redelivered),
        )
        try:
            callback(delivery)
        except Exception:
            log.exception("consumer_callback_failed", connection=connection_name)

    return on_message
